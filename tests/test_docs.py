"""The documentation says what the code does: generated pages match their generators, every setting the
code reads is documented (and nothing else), every `requests` column is listed, links resolve, the nav
holds every page, and README.md stays a short front page. (``mkdocs build --strict`` runs in
scripts/test.sh, not here.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from ledger.fold import AGGREGATES
from ledger.schema import ATTRIBUTION, SPAN
from tests.support import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
CONFIG_PAGE = DOCS / "reference" / "configuration.md"
EVENTS_PAGE = DOCS / "reference" / "events.md"
TABLES_PAGE = DOCS / "reference" / "tables.md"


def section(text: str, name: str) -> str:
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", text, re.S)
    assert m, f"lacks the <!-- {name}:begin --> ... <!-- {name}:end --> markers"
    return m.group(1)


def test_event_contract_page_is_the_generated_one():
    import tools.contract_md as gen

    assert section(EVENTS_PAGE.read_text(), "contract") == gen.render(), (
        "run: python -m tools.contract_md --write"
    )


def test_configuration_page_is_the_generated_one():
    import tools.config_md as gen

    assert section(CONFIG_PAGE.read_text(), "config") == gen.render(), (
        "run: python -m tools.config_md --write"
    )


def _source_files() -> list[Path]:
    files = [
        p for d in ("chunkledger", "ledger", "engine_hooks", "dashboard") for p in (ROOT / d).rglob("*.py")
    ]
    files += [p for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh")]
    return sorted(files)


def code_variables() -> dict[str, list[str]]:
    """Every complete CHUNKLEDGER_* name in the sources (a prefix ending in ``_``, composed at run time
    like ``CHUNKLEDGER_VLLM_``, is not a name), with the files that hold it."""
    found: dict[str, list[str]] = {}
    for path in _source_files():
        for m in re.finditer(r"CHUNKLEDGER_[A-Z0-9_]+", path.read_text()):
            if not m[0].endswith("_"):
                found.setdefault(m[0], []).append(str(path.relative_to(ROOT)))
    return found


def documented_variables() -> set[str]:
    """The variables the configuration page's tables document (a row's first cell)."""
    rows = re.findall(r"^\| `(CHUNKLEDGER_[A-Z0-9_]+)` \|", section(CONFIG_PAGE.read_text(), "config"), re.M)
    return set(rows)


def test_every_variable_the_code_reads_is_documented():
    missing = {v: files for v, files in code_variables().items() if v not in documented_variables()}
    assert not missing, (
        f"not on {CONFIG_PAGE.relative_to(ROOT)} (run: python -m tools.config_md --write): {missing}"
    )


def test_every_documented_variable_exists_in_code():
    from engine_hooks.config import ENV_PREFIX, ExporterConfig
    from engine_hooks.vllm.options import ENV_PREFIX as VLLM_PREFIX
    from engine_hooks.vllm.options import LedgerOptions
    from ledger.config import Settings

    composed = {f"CHUNKLEDGER_{n.upper()}" for n in Settings.model_fields}
    composed |= {ENV_PREFIX + n.upper() for n in ExporterConfig.__struct_fields__}
    composed |= {VLLM_PREFIX + n.upper() for n in LedgerOptions.__struct_fields__}
    unknown = documented_variables() - composed - set(code_variables())
    assert not unknown, f"documented but read nowhere: {sorted(unknown)}"


def test_tables_page_lists_every_requests_column():
    listed = section(TABLES_PAGE.read_text(), "requests")
    missing = [c for c in ["request_id", *AGGREGATES, *ATTRIBUTION, *SPAN] if f"| `{c}` |" not in listed]
    assert not missing, f"columns missing from {TABLES_PAGE.relative_to(ROOT)}: {missing}"


def test_readme_is_a_short_front_page_with_the_two_commands_first():
    text = README.read_text()
    assert len(text.splitlines()) < 200, "README.md must stay under 200 lines: move detail to docs/"
    first = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    assert first, "README.md has no fenced code block"
    assert "scripts/demo.sh" in first[1] and "scripts/test.sh" in first[1], (
        "README.md's first code block must be the two commands (scripts/demo.sh, scripts/test.sh)"
    )


def _markdown_files() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


_FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    links = [m[1] for m in _LINK.finditer(text)]
    return [u for u in links if not re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", u)]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(path: Path):
    assert path.exists(), f"{path.relative_to(ROOT)} is missing"
    broken = [u for u in relative_links(path) if not (path.parent / u.split("#")[0]).exists()]
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


_REPO_PATH = re.compile(
    r"`((?:chunkledger|ledger|engine_hooks|dashboard|bench|tools|scripts|tests|deploy|migrations|docs)/[\w./-]+"
    r"\.(?:py|md|sh|toml|yml|yaml|json|ini))`"
)


@pytest.mark.parametrize(
    "path", [p for p in _markdown_files() if p.name != "CHANGELOG.md"], ids=lambda p: str(p.relative_to(ROOT))
)
def test_file_paths_named_in_the_docs_exist(path: Path):
    """A path in backticks (`chunkledger/sql.py`) names a file of this repository that exists (the
    CHANGELOG is history: it may name files that are gone)."""
    missing = sorted({m[1] for m in _REPO_PATH.finditer(path.read_text()) if not (ROOT / m[1]).exists()})
    assert not missing, f"{path.relative_to(ROOT)} names files that do not exist: {missing}"


def test_no_file_mentions_the_retired_architecture_page():
    name = "ARCHITECTURE" + ".md"  # split, so this file does not match itself

    def ours(p: Path) -> bool:  # not a virtualenv, cache or build output
        parts = p.relative_to(ROOT).parts
        return not any(
            (x.startswith(".") and x not in (".ci", ".github"))
            or x in ("site", "node_modules", "__pycache__")
            for x in parts[:-1]
        ) and not parts[0].endswith(".egg-info")

    hits = [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.suffix in (".py", ".md", ".sh", ".toml", ".yml", ".yaml")
        and ours(p)
        and p.is_file()
        and name in p.read_text(errors="replace")
    ]
    assert not hits, f"{name} is gone (its content is docs/design.md); still named in: {hits}"


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = set(_nav_pages(config["nav"]))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"
