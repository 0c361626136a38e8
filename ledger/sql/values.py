"""Values and type names as the API returns them: JSON-safe values, portable type names, and the
output formats (JSON bytes, CSV, the console table) and ``--param`` parsing."""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import json
import math
import re
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

# -- JSON-safe values --------------------------------------------------------------------------


def json_value(v: Any) -> Any:
    """A JSON-safe form of one database value.

    int/str/bool/None as is; finite floats as is, NaN and ±Infinity as null; Decimal as an int when
    integral (PostgreSQL sums) else a float; datetime/date/time as ISO 8601 strings (timezone-aware
    ones with their offset); timedelta as seconds (float); UUID as its string; bytes as base64;
    lists and structs recursively (map keys as strings).
    """
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, decimal.Decimal):
        if not v.is_finite():
            return None
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode()
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    return str(v)


_PLAIN = {"integer", "boolean"}
_TEXT = {"VARCHAR", "TEXT", "CHARACTER VARYING", "BPCHAR", "NAME", "CHAR"}


def _converter(native: str, portable: str) -> Callable[[Any], Any] | None:
    """None where values are already JSON-safe: ints, booleans, text (most ledger columns)."""
    if portable in _PLAIN or re.sub(r"\(.*\)$", "", native.strip()).upper() in _TEXT:
        return None
    return json_value


def convert_rows(raw: list[Any], natives: list[str], types: list[str]) -> list[list[Any]]:
    convs = [_converter(n, t) for n, t in zip(natives, types, strict=True)]
    if all(c is None for c in convs):
        return [list(r) for r in raw]
    return [[v if c is None else c(v) for v, c in zip(r, convs, strict=True)] for r in raw]


# -- type names ----------------------------------------------------------------------------------

_TYPE_WORDS = [
    (("HUGEINT", "UHUGEINT", "BIGINT", "UBIGINT", "INTEGER", "UINTEGER", "SMALLINT", "USMALLINT"), "integer"),
    (("TINYINT", "UTINYINT", "INT2", "INT4", "INT8", "OID", "INT", "INT64"), "integer"),
    (("DOUBLE", "FLOAT", "REAL", "FLOAT4", "FLOAT8", "DOUBLE PRECISION"), "float"),
    (("DECIMAL", "NUMERIC"), "decimal"),
    (("VARCHAR", "TEXT", "CHAR", "BPCHAR", "NAME", "CHARACTER VARYING", "CHARACTER", "UUID"), "string"),
    (("BOOLEAN", "BOOL"), "boolean"),
    (("TIMESTAMP", "TIMESTAMPTZ", "TIMESTAMP WITH TIME ZONE", "TIMESTAMP_NS", "TIMESTAMP_MS"), "timestamp"),
    (("TIMESTAMP_S", "TIMESTAMP WITHOUT TIME ZONE"), "timestamp"),
    (("DATE",), "date"),
    (("TIME", "TIMETZ", "TIME WITH TIME ZONE", "TIME WITHOUT TIME ZONE"), "time"),
    (("INTERVAL",), "interval"),
    (("JSON", "JSONB"), "json"),
    (("BLOB", "BYTEA"), "blob"),
    (('"NULL"', "NULL", "UNKNOWN"), "null"),
]
_TYPE_MAP = {w: name for words, name in _TYPE_WORDS for w in words}


def type_name(native: str) -> str:
    """The portable name of a DuckDB or PostgreSQL column type.

    integer, float, decimal, string, boolean, timestamp, date, time, interval, json, blob, null,
    list<T>, struct, map; anything else as the database's own name in lower case.
    """
    t = native.strip()
    if t.endswith("[]"):
        return f"list<{type_name(t[:-2])}>"
    upper = re.sub(r"\(.*\)$", "", t).strip().upper()
    if upper in _TYPE_MAP:
        return _TYPE_MAP[upper]
    for prefix, name in (("STRUCT", "struct"), ("MAP", "map"), ("UNION", "struct"), ("ENUM", "string")):
        if upper.startswith(prefix):
            return name
    if upper.startswith("_"):  # PostgreSQL's internal array names
        return f"list<{type_name(upper[1:])}>"
    return t.lower()


def dumps(obj: Any) -> bytes:
    """Compact JSON; values must already be JSON-safe (``json_value``)."""
    return _encode(obj)


_encode = msgspec.json.Encoder().encode


# -- output formats (API CSV and the ``chunkledger query`` console) -------------------------------


def csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    return v


def to_csv(columns: list[str], rows: list[list[Any]]) -> str:
    """RFC 4180 CSV with a header row; NULL as an empty field, lists and structs as JSON."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        w.writerow([csv_cell(v) for v in row])
    return buf.getvalue()


_NUMERIC = {"integer", "float", "decimal"}


def _cell(v: Any, width: int) -> str:
    if v is None:
        text = "NULL"
    elif isinstance(v, bool):
        text = "true" if v else "false"
    elif isinstance(v, float):
        text = f"{v:.6f}".rstrip("0").rstrip(".") if abs(v) >= 1e-6 or v == 0 else f"{v:.3g}"
    elif isinstance(v, (list, dict)):
        text = json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    else:
        text = str(v)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def to_table(columns: list[str], types: list[str], rows: list[list[Any]], *, width: int = 60) -> str:
    """Aligned columns for a terminal: numbers right-aligned, floats to 6 decimals, long cells cut."""
    cells = [[_cell(v, width) for v in row] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    right = [t in _NUMERIC for t in types]

    def line(values: list[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True)]
        return " | ".join(parts).rstrip()

    out = [line(columns), "-+-".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def parse_param(text: str) -> tuple[str, Any]:
    """``name=value`` with the value read as JSON when it parses (numbers, true, null), else a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--param {text!r}: expected name=value")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return name, value
