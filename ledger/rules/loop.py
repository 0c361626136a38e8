"""Incremental loop detector over a request's output token ids.

A degenerate loop is a tail of the output that repeats a block of ``p`` tokens (``1 <= p <= max_period``)
over and over. The tail ``t[i-L+1 .. i]`` has period ``p`` when ``t[j] == t[j-p]`` for every ``j`` in it
but the first ``p``; we call ``run(p)`` the number of consecutive positions ending at ``i`` where that
equality holds, so the periodic tail is ``run(p) + p`` tokens long and holds ``run(p) / p + 1`` repeats.
A loop is reported when, for some ``p``, the tail holds at least ``min_repeats`` repeats **and** spans at
least ``min_span_tokens`` tokens (short periods need many repeats before they are a loop: a markdown
separator row or a short JSON array of zeros is periodic too).

Checking every ``p`` at every token costs ``O(max_period)``. Instead, candidate periods are discovered
from the last occurrence of the current bigram: in a loop of period ``p`` the bigram just produced last
occurred exactly ``p`` tokens ago. Each candidate keeps its own ``run`` and is checked with one
comparison per token; it is dropped as soon as the equality fails. Natural text produces short-lived
candidates (a bigram seen a few tokens ago), a loop produces one that never dies. Per token: one dict
update, one dict lookup and at most ``MAX_CANDIDATES`` comparisons — constant work (the bigram map is
rebuilt from the ring when it outgrows ``4 * (max_period + 3)`` entries: amortised O(1)). Memory per
request: a ring of ``max_period + 3`` tokens and that bounded bigram map.

A candidate starts with ``run = 2`` (the repeated bigram) and then counts exactly, so the detector never
fires early, and it fires on the token that completes ``min_repeats`` periods (and the span) when the
candidate was found at once. It can be later by about a period when the block repeats bigrams of its
own (the distance-``p`` candidate is found after a shorter, wrong one dies); tests bound this against a
brute-force reference.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

MAX_CANDIDATES = 8


@dataclass(frozen=True)
class LoopHit:
    at: int  # index (0-based, over the whole output) of the token on which the loop was detected
    period: int  # tokens per repeat
    repeats: int  # full repeats in the periodic tail at detection
    span: int  # length of the periodic tail at detection, in tokens


class LoopDetector:
    """Feed output token ids in order with ``push``/``extend``; ``hit`` is set at the first loop."""

    __slots__ = (
        "_cands",
        "_last",
        "_needs",
        "_prev",
        "_ring",
        "_size",
        "hit",
        "max_period",
        "min_repeats",
        "min_span_tokens",
        "n",
    )

    def __init__(self, *, max_period: int, min_repeats: int, min_span_tokens: int) -> None:
        if max_period < 1 or min_repeats < 2 or min_span_tokens < 2:
            raise ValueError("max_period >= 1, min_repeats >= 2 and min_span_tokens >= 2 are required")
        self.max_period = max_period
        self.min_repeats = min_repeats
        self.min_span_tokens = min_span_tokens
        self._size = max_period + 3
        self._ring = [0] * self._size  # the last max_period + 3 tokens; position j at j % size
        # bigram ending at position j -> latest j; the bigram (a, b) is keyed by the int a << 32 | b,
        # cheaper to build and hash than a tuple (exact for ids in 0..2**32; candidates are checked)
        self._last: dict[int, int] = {}
        self._cands: dict[int, int] = {}  # candidate period -> run of matches ending at the last token
        self._needs = _needs(max_period, min_repeats, min_span_tokens)
        self._prev = 0  # the last token
        self.n = 0  # tokens seen
        self.hit: LoopHit | None = None

    def push(self, token: int) -> LoopHit | None:
        """Add one token; returns the hit on the token where a loop is first detected, else None."""
        return self.extend((token,))

    def extend(self, tokens: Iterable[int]) -> LoopHit | None:
        """Add tokens in order; the hit on the token where a loop is first detected, else None.

        Once a loop is found the detector stops: later calls add nothing and return None.
        """
        if self.hit is not None:
            return None
        ring, size, last, cands, needs = self._ring, self._size, self._last, self._cands, self._needs
        max_period = self.max_period
        i, prev_tok = self.n, self._prev
        for token in tokens:
            ring[i % size] = token
            if i:
                if cands:
                    dead = None
                    for p, run in cands.items():
                        if ring[(i - p) % size] == token:
                            run += 1
                            cands[p] = run
                            if run >= needs[p]:
                                return self._fire(i, token, p, run)
                        elif dead is None:
                            dead = [p]
                        else:
                            dead.append(p)
                    if dead:
                        for p in dead:
                            del cands[p]
                key = prev_tok << 32 | token
                prev = last.get(key)
                last[key] = i
                if prev is not None:
                    d = i - prev
                    # The equality check makes a key collision (ids outside 0..2**32) harmless.
                    if (
                        d <= max_period
                        and d not in cands
                        and ring[(i - d) % size] == token
                        and ring[(i - 1 - d) % size] == prev_tok
                    ):
                        if len(cands) >= MAX_CANDIDATES:
                            del cands[min(cands, key=cands.__getitem__)]
                        cands[d] = 2  # t[i] == t[i-d] and t[i-1] == t[i-1-d]: the repeated bigram
                        if needs[d] <= 2:
                            return self._fire(i, token, d, 2)
                if len(last) > 4 * size:
                    # Only bigrams of the last max_period + 1 positions can still give a period:
                    # rebuild from the ring every ~3 * max_period tokens (amortised O(1) per token).
                    last.clear()
                    for j in range(max(1, i - max_period), i + 1):
                        last[ring[(j - 1) % size] << 32 | ring[j % size]] = j
            prev_tok = token
            i += 1
        self.n, self._prev = i, prev_tok
        return None

    def _fire(self, i: int, token: int, p: int, run: int) -> LoopHit:
        self.n, self._prev = i + 1, token
        span = run + p
        self.hit = LoopHit(at=i, period=p, repeats=span // p, span=span)
        return self.hit


@functools.cache
def _needs(max_period: int, min_repeats: int, min_span_tokens: int) -> tuple[int, ...]:
    """The run needed to fire, per period: (min_repeats - 1) periods of matches and the span.

    Shared by every detector with the same settings (one per live request: building it per request
    cost more than the request's own tokens)."""
    return (0, *(max((min_repeats - 1) * p, min_span_tokens - p) for p in range(1, max_period + 1)))


def find_loop(
    tokens: Iterable[int], *, max_period: int, min_repeats: int, min_span_tokens: int
) -> LoopHit | None:
    """Run a fresh detector over a whole output: where it would have cut, or None."""
    det = LoopDetector(max_period=max_period, min_repeats=min_repeats, min_span_tokens=min_span_tokens)
    return det.extend(tokens)
