"""What every SQL runner shares: the error, the result, and the capped fetch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from ledger.records import Record

Params = Mapping[str, Any] | None


class SqlError(Exception):
    """A refused or failed query: HTTP ``status``, a short machine ``reason`` and a message for people."""

    def __init__(self, reason: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status

    def as_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "detail": self.message}


class SqlResult(Record, kw_only=False):
    """``POST /v1/sql`` as JSON (``format=csv`` or ``Accept: text/csv``: CSV, with the types and the
    truncation in ``X-Chunkledger-*`` headers). ``as_dict`` is what is sent (the values as
    ``ledger.sql.values.dumps`` writes them)."""

    columns: list[str]
    types: Annotated[list[str], msgspec.Meta(description="portable type per column: int, float, str, ...")]
    rows: list[list[Any]]
    truncated: bool
    elapsed_s: float
    truncated_by: Annotated[
        str | None, msgspec.Meta(description="rows (max_rows) or bytes (sql_max_bytes)")
    ] = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "columns": self.columns,
            "types": self.types,
            "rows": self.rows,
            "truncated": self.truncated,
            "truncated_by": self.truncated_by,
            "elapsed_s": round(self.elapsed_s, 6),
        }


def _value_bytes(v: Any) -> int:
    """About how many bytes a result value takes in the answer."""
    if isinstance(v, (str, bytes)):
        return len(v) + 2
    if isinstance(v, (list, tuple)):
        return 2 + sum(_value_bytes(x) + 1 for x in v)
    if isinstance(v, dict):
        return 2 + sum(len(str(k)) + 4 + _value_bytes(x) for k, x in v.items())
    return 8


def fetch_capped(cur: Any, max_rows: int, max_bytes: int | None) -> tuple[list[Any], str | None]:
    """Rows of an executed cursor up to ``max_rows`` and about ``max_bytes`` of values, fetched in
    chunks (a 10,000-row cap over 50 KB strings must not build a 500 MB answer); (rows, what cut them)."""
    rows: list[Any] = []
    size = 0
    while len(rows) <= max_rows:
        chunk = cur.fetchmany(min(1000, max_rows + 1 - len(rows)))
        if not chunk:
            return rows, None
        if max_bytes is not None:
            for i, row in enumerate(chunk):
                size += 4 + sum(_value_bytes(v) + 1 for v in row)
                if size > max_bytes:
                    rows.extend(chunk[:i])
                    return rows, "bytes"
        rows.extend(chunk)
    return rows[:max_rows], "rows"
