"""Time windows as users write them: unix seconds, ISO 8601, or "how long ago" (``15m``, ``2h``)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class BadTime(ValueError):
    """A time the user wrote that is none of the accepted forms."""


def parse_time(text: str | float | None, *, now: float | None = None) -> float | None:
    """Unix seconds for ``text``: a number, an ISO 8601 time (UTC unless it says), or ``<n><s|m|h|d>``
    meaning that long before ``now``. None stays None."""
    if text is None or text == "":
        return None
    if isinstance(text, int | float):
        return float(text)
    m = _AGO.match(text)
    if m:
        return (time.time() if now is None else now) - float(m[1]) * _UNIT_S[m[2]]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise BadTime(
            f"{text!r} is not a time: use unix seconds, ISO 8601 (2026-12-01T10:00:00Z) "
            "or an age like 15m, 2h"
        ) from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


@dataclass(frozen=True)
class Window:
    """[since, until) in unix seconds; either end open when None."""

    since: float | None = None
    until: float | None = None

    @classmethod
    def parse(
        cls, since: str | float | None, until: str | float | None, *, now: float | None = None
    ) -> Window:
        now = time.time() if now is None else now
        w = cls(parse_time(since, now=now), parse_time(until, now=now))
        if w.since is not None and w.until is not None and w.until <= w.since:
            raise BadTime(f"until ({w.until}) must be after since ({w.since})")
        return w
