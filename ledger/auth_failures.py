"""Failed token checks per client address: counted, logged, and limited.

An address that sends more than ``auth_failures_per_minute`` unknown tokens within a minute gets 429
(``too_many_failed_tokens``, with ``Retry-After``) for every token-bearing request until that minute is
over: guessing the admin or read token costs a minute per ``auth_failures_per_minute`` guesses. The first
failure of an address in a minute and the moment it is limited are logged (not every failure: 900
guesses a second would flood the log); every failure is counted in
``chunkledger_auth_failures_total{reason}``. At most ``MAX_ADDRESSES`` addresses are tracked (the oldest
forgotten first), so the table cannot grow without bound.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

WINDOW_S = 60.0
MAX_ADDRESSES = 10_000


class FailedTokens:
    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # address -> (window start, failures in it)

    def _current(self, address: str, now: float) -> tuple[float, int]:
        start, n = self._seen.get(address, (now, 0))
        if now - start >= WINDOW_S:
            return now, 0
        return start, n

    def retry_after(self, address: str) -> int | None:
        """Seconds until ``address`` may try tokens again, or None when it may now."""
        now = self._clock()
        start, n = self._current(address, now)
        if n < self.per_minute:
            return None
        return max(1, math.ceil(start + WINDOW_S - now))

    def failed(self, address: str, reason: str, role: str) -> None:
        """Record one failed check (``reason``: unknown_token, ...)."""
        now = self._clock()
        start, n = self._current(address, now)
        if n == 0:
            log.warning("failed token check from %s (%s, %s endpoint)", address, reason, role)
        n += 1
        if n == self.per_minute:
            log.warning(
                "%s: %d failed token checks within a minute; refusing its tokens (429) for %.0f s",
                address,
                n,
                start + WINDOW_S - now,
            )
        self._seen.pop(address, None)
        self._seen[address] = (start, n)
        if len(self._seen) > MAX_ADDRESSES:
            del self._seen[next(iter(self._seen))]
