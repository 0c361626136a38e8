"""Generated blocks in the docs: the text between ``<!-- name:begin -->`` and ``<!-- name:end -->``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def replace_between(page: Path, begin: str, end: str, body: str) -> bool:
    """Put ``body`` between the markers of ``page``; True when the page changed."""
    text = page.read_text()
    head, sep, rest = text.partition(begin + "\n")
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise SystemExit(f"{page} lacks the {begin} ... {end} markers")
    new = head + begin + "\n" + body + end + tail
    if new != text:
        page.write_text(new)
    return new != text


def main(
    description: str, page: Path, begin: str, end: str, render: Callable[[], str], argv: list[str] | None
) -> None:
    """The generators' command line: print the block, or ``--write`` it into ``page``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--write", action="store_true", help=f"update {page.name} in place")
    args = ap.parse_args(argv)
    if args.write:
        changed = replace_between(page, begin, end, render())
        print(f"{page}: {'updated' if changed else 'unchanged'}")
    else:
        sys.stdout.write(render())
