"""The README documents the contract and the tables exactly as the code defines them."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from ledger.fold import AGGREGATES
from ledger.schema import ATTRIBUTION, SPAN

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _section(name: str) -> str:
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", README, re.S)
    assert m, f"README lacks the {name} section"
    return m.group(1)


def test_readme_event_contract_is_the_generated_one():
    import tools.contract_md as gen

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gen.main()
    assert _section("contract").strip() == out.getvalue().strip(), "run: python tools/contract_md.py"


def test_readme_lists_every_requests_column():
    section = _section("requests")
    for col in ["request_id", *AGGREGATES, *ATTRIBUTION, *SPAN]:
        assert f"| `{col}` |" in section, col
