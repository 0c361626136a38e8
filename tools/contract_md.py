"""Generate the event contract's Markdown tables (docs/reference/events.md) from engine_hooks/events.py.

    python -m tools.contract_md            # print the generated block
    python -m tools.contract_md --write    # replace the block between the contract markers of the page

Types, defaults and meanings come from the Structs' source (each field's trailing comment);
tests/test_docs.py keeps the page equal to this output.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import re
from pathlib import Path

import msgspec

from engine_hooks import events as ev
from tools import markers
from tools.markers import replace_between

ROOT = Path(__file__).resolve().parents[1]

PAGE = ROOT / "docs" / "reference" / "events.md"
BEGIN, END = "<!-- contract:begin -->", "<!-- contract:end -->"

_FIELD = re.compile(r"^\s{4}(\w+): ([^=#\n]+?)(?: = ([^#\n]+?))?\s*(?:#\s*(.*))?$", re.M)


def field_docs(cls: type) -> dict[str, tuple[str, str, str]]:
    """Type, default and trailing comment of each field, from the source of the class and its bases."""
    out: dict[str, tuple[str, str, str]] = {}
    for klass in reversed([k for k in cls.__mro__ if k.__module__ == ev.__name__]):
        source = inspect.getsource(klass)
        for m in _FIELD.finditer(source):
            comment = (m[4] or "").strip()
            if comment:  # comment lines right below continue the field's comment
                for line in source[m.end() + 1 :].splitlines():
                    more = re.match(r"^\s{4}#\s?(.*)$", line)
                    if not more:
                        break
                    comment += " " + more[1].strip()
            out[m[1]] = (m[2].strip(), (m[3] or "").strip(), comment)
    return out


def table(cls: type, skip: set[str]) -> str:
    docs = field_docs(cls)
    rows = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for f in msgspec.structs.fields(cls):
        if f.name in skip:
            continue
        t, d, c = docs.get(f.name, ("", "", ""))
        c = c.replace("<", "&lt;")  # "chunkledger:<rule>" is text, not an HTML tag
        rows.append(
            f"| `{f.name}` | `{t}` | {d or ('required' if f.required else '')} | {c} |".replace(
                " | None`", " \\| None`"
            )
        )
    return "\n".join(rows)


_TYPES = (
    "Seq",
    "Int64",
    "NonNegInt64",
    "NonNegInt",
    "NonNegFloat",
    "Timestamp",
    "StatusCode",
    "RequestId",
    "Name",
    "Ratio",
)
_BOUNDS = (("ge", ">= {}"), ("gt", "> {}"), ("le", "<= {}"), ("lt", "< {}"))


def _bound(v: float) -> str:
    for exp in (63, 31):
        if v in (2**exp - 1, -(2**exp)):
            return f"{'-' if v < 0 else ''}2^{exp}{' - 1' if v > 0 else ''}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def types_table() -> str:
    """The named field types and their ranges (every value outside them is a 422 naming the field)."""
    rows = ["| type | values |", "|---|---|"]
    for name in _TYPES:
        alias = getattr(ev, name)
        base, meta = alias.__origin__, alias.__metadata__[0]
        parts = [fmt.format(_bound(getattr(meta, k))) for k, fmt in _BOUNDS if getattr(meta, k) is not None]
        if meta.min_length is not None:
            parts.append(f"{meta.min_length} to {meta.max_length} characters")
        rows.append(f"| `{name}` | {base.__name__}, {', '.join(parts)} |")
    return "\n".join(rows)


def print_contract() -> None:
    common = {"seq", "ts", "request_id"}
    print("Field types (a value outside its range is a 422 naming the field):\n")
    print(types_table())
    print()
    print("Every event: `kind` (the tag below), plus\n")
    print(table(ev.Arrived, set(f.name for f in msgspec.structs.fields(ev.Arrived)) - common))
    print("\n(`request_id` on every kind but `step` and `dropped`.)\n")
    for kind, cls in ev.EVENT_TYPES.items():
        origin = (
            "gateway" if kind in ev.GATEWAY_KINDS else ("engine" if kind in ev.ENGINE_KINDS else "any source")
        )
        doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
        print(f"#### `{kind}` ({origin})\n\n{doc}\n")
        print(table(cls, common))
        print()


def render() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_contract()
    return out.getvalue().strip() + "\n"


def write(page: Path = PAGE) -> bool:
    """Replace the block between the markers; True when the page changed."""
    return replace_between(page, BEGIN, END, render())


def main(argv: list[str] | None = None) -> None:
    markers.main("Generate the event contract's Markdown tables.", PAGE, BEGIN, END, render, argv)


if __name__ == "__main__":
    main()
