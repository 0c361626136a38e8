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
update, one dict lookup and at most ``MAX_CANDIDATES`` comparisons — constant work. Memory per request:
a ring of ``max_period + 3`` tokens and a bigram map bounded by the same number of entries.

A candidate is found once its bigram repeats, so ``run`` starts at 2 (the bigram) and then counts exactly;
the detector therefore fires on the very token that completes ``min_repeats`` periods (or the span),
never later.
"""

from __future__ import annotations

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
        self._last: dict[tuple[int, int], int] = {}  # bigram ending at position j -> latest j
        self._cands: dict[int, int] = {}  # candidate period -> run of matches ending at the last token
        self.n = 0  # tokens seen
        self.hit: LoopHit | None = None

    def push(self, token: int) -> LoopHit | None:
        """Add one token; returns the hit on the token where a loop is first detected, else None."""
        i = self.n
        ring, size = self._ring, self._size
        ring[i % size] = token
        self.n = i + 1
        if i == 0:
            return None
        cands = self._cands
        if cands:
            dead = None
            for p, run in cands.items():
                if ring[(i - p) % size] == token:
                    cands[p] = run + 1
                else:
                    dead = [p] if dead is None else [*dead, p]
            if dead:
                for p in dead:
                    del cands[p]
        key = (ring[(i - 1) % size], token)
        last = self._last
        prev = last.get(key)
        last[key] = i
        old = i - self.max_period - 1  # bigrams ending here can no longer give a period <= max_period
        if old >= 1:
            old_key = (ring[(old - 1) % size], ring[old % size])
            if last.get(old_key) == old:
                del last[old_key]
        if prev is not None:
            d = i - prev
            if d <= self.max_period and d not in cands:
                if len(cands) >= MAX_CANDIDATES:
                    del cands[min(cands, key=cands.__getitem__)]
                cands[d] = 2  # t[i] == t[i-d] and t[i-1] == t[i-1-d]: the repeated bigram
        if self.hit is None and cands:
            for p, run in cands.items():
                span = run + p
                if run >= (self.min_repeats - 1) * p and span >= self.min_span_tokens:
                    self.hit = LoopHit(at=i, period=p, repeats=span // p, span=span)
                    return self.hit
        return None

    def extend(self, tokens: Iterable[int]) -> LoopHit | None:
        """Add tokens in order; the first hit among them (detection stops adding at the hit)."""
        if self.hit is not None:
            return None
        push = self.push
        for t in tokens:
            h = push(t)
            if h is not None:
                return h
        return None


def find_loop(
    tokens: Iterable[int], *, max_period: int, min_repeats: int, min_span_tokens: int
) -> LoopHit | None:
    """Run a fresh detector over a whole output: where it would have cut, or None."""
    det = LoopDetector(max_period=max_period, min_repeats=min_repeats, min_span_tokens=min_span_tokens)
    return det.extend(tokens)
