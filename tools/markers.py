"""Generated blocks in the docs: the text between ``<!-- name:begin -->`` and ``<!-- name:end -->``."""

from __future__ import annotations

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
