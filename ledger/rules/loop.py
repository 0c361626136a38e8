"""Incremental loop detector over a request's output token ids.

A degenerate loop is a tail of the output that repeats a block of ``p`` tokens (``1 <= p <= max_period``)
over and over. The tail ``t[i-L+1 .. i]`` has period ``p`` when ``t[j] == t[j-p]`` for every ``j`` in it
but the first ``p``; ``run(p)`` is the number of consecutive positions ending at ``i`` where that
equality holds, so the periodic tail (the *span*) is ``run(p) + p`` tokens long and holds
``span / p`` repeats. A loop is reported on the first token where, for some ``p``, the span reaches
both ``min_repeats * p + confirm_tokens`` and ``min_span_tokens`` (a short period needs many repeats
before it is a loop: a markdown separator row or a short JSON array of zeros is periodic too; a long one
is confirmed a few tokens past its last required repeat: a JSON array of flags can say its pattern a
little more than twice). The defaults, ``max(64, 2p + 16)``, are in ``ledger.rules.policy``.

**Finding the period in constant work per token.** Checking every ``p`` at every token costs
``O(max_period)``. Instead the detector keeps an LZ77-style hash chain over the bigrams of the last
``max_period + 1`` positions: ``head[hash(bigram)]`` is the newest position of a bigram with that hash
and ``chain[pos]`` the one before it. In a loop of period ``p`` the bigram just produced occurred exactly
``p`` tokens ago, so walking at most ``MAX_CHAIN`` links of the chain from the current bigram finds the
distance ``p`` (the walk only skips it when the bigram occurs more than ``MAX_CHAIN`` times within one
period, and then another bigram of the block finds it). A distance whose bigram (and the token before)
really matches becomes a *candidate*; its run is measured exactly by scanning back from the current
token (natural text: one or two comparisons; a loop: once per candidate). Each live candidate then
costs one comparison per token and is dropped at its first mismatch. So the detector fires on exactly
the token a brute-force check of every period would (``brute_force_first_hit`` in the tests), except
when the chain walk is cut short, and then it is late, never early or wrong.

**Near-loops** (``changes=1``): the same block repeated with one token changed per repeat (a counter,
a date). A candidate then survives one mismatch per period: it dies only at a second mismatch less than
``p`` positions after the previous one. Numbered lists of different items change more than one token
per repeat and are not near-loops; a table whose rows differ in a single cell is one while it lasts, so
the rule's default span (768 tokens, ``ledger.rules.policy``) is half as long again as the longest such
legitimate block of the corpus (498).

**Memory per detector** (one per live request, made on its first output ids): a ring of the last
``window`` tokens, ``window = max(min_span_tokens, min_repeats * max_period + confirm_tokens) + 1``
(1,041 for the defaults), a chain of ``max_period + 1`` positions, and a fixed hash table of the next
power of two at or above ``max_period + 1`` slots (1,024); the ring and chain grow with the output, so a
short answer holds only its own tokens. At most ``MAX_CANDIDATES`` candidates. ``state_slots`` counts
them: at most 2,578 slots.

**Two implementations, the same answers.** ``LoopDetector`` is the compiled one
(``ledger.rules._loopc``, C, built by ``pip install``; ``COMPILED`` says whether it loaded) and
``PyLoopDetector`` the pure-Python reference it is tested against (every hit and ``n`` on the shipped
corpus and on random streams; ``LoopDetector`` falls back to it where the extension is missing).
Compiled, token ids are checked (``0 <= id <= 2**31 - 1``, ValueError otherwise, before any id of the
call is added) and held as 4-byte ints, positions as 4-byte offsets (rebased every 2**31 tokens): the
2,578 slots are 10.5 KiB in all once an output passes 1,041 tokens and 5 KiB for a 64-token answer
(most of it the hash table; ``sys.getsizeof`` counts everything), where the Python detector's lists and
ints hold about 70 KiB and 10 KiB. Cost per token (``python -m bench.loopdetect``, no detector firing so
every id is paid for): 16 ids per call as the ledger feeds them, about 18 ns compiled against 0.6 us in
Python; a fleet of 8,000 live requests getting 1-4 ids each per ingest group, ``extend_many`` (one call
per group) about 85 ns per id, one ``extend`` per request about 150 ns compiled and 2 us in Python
(there the cost is mostly cache misses on thousands of detectors' state, which ``extend_many``
prefetches).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

MAX_CANDIDATES = 8  # live candidate periods (a loop of period p also gives 2p, 3p, ...)
MAX_CHAIN = (
    2  # hash-chain links walked per token (4: 1.4x the cost, same answers on the corpus's exact loops)
)
_MIN_RUN = 3  # a candidate is kept once three consecutive tokens match (rechecked every token until then)
_FAR = -(1 << 62)  # "no position": every distance from it exceeds max_period
_MULT = 0x9E3779B1  # Fibonacci hashing of the bigram


@dataclass(frozen=True)
class LoopHit:
    at: int  # index (0-based, over the whole output) of the token on which the loop was detected
    period: int  # tokens per repeat
    repeats: int  # full repeats in the periodic tail at detection
    span: int  # length of the periodic tail at detection, in tokens
    changes: int = 0  # tokens that differed from one period before, within the span (near-loops)


class PyLoopDetector:
    """Feed output token ids in order with ``push``/``extend``; ``hit`` is set at the first loop.

    The pure-Python reference: ``LoopDetector`` (compiled) gives the same answers."""

    __slots__ = (
        "_cands",
        "_chain",
        "_csize",
        "_head",
        "_mask",
        "_mism",
        "_needs",
        "_prev",
        "_ring",
        "_size",
        "changes",
        "confirm_tokens",
        "hit",
        "max_period",
        "min_period",
        "min_repeats",
        "min_span_tokens",
        "n",
    )

    def __init__(
        self,
        *,
        max_period: int,
        min_repeats: int,
        min_span_tokens: int,
        min_period: int = 1,
        changes: int = 0,
        confirm_tokens: int = 0,
    ) -> None:
        if max_period < 1 or min_repeats < 2 or min_span_tokens < 2:
            raise ValueError("max_period >= 1, min_repeats >= 2 and min_span_tokens >= 2 are required")
        if confirm_tokens < 0:
            raise ValueError("confirm_tokens >= 0 is required")
        if not 1 <= min_period <= max_period:
            raise ValueError("1 <= min_period <= max_period is required")
        if changes not in (0, 1):
            raise ValueError("changes must be 0 (exact loops) or 1 (one changed token per repeat)")
        self.max_period = max_period
        self.min_period = min_period
        self.min_repeats = min_repeats
        self.min_span_tokens = min_span_tokens
        self.changes = changes
        self.confirm_tokens = confirm_tokens
        self._needs = _needs(max_period, min_repeats, min_span_tokens, min_period, confirm_tokens)
        # The ring holds the longest span that can be needed, so a candidate's run is measured exactly.
        self._size = max(min_span_tokens, min_repeats * max_period + confirm_tokens) + 1
        self._csize = max_period + 1
        self._ring: list[int] = []  # token at position j is _ring[j % _size] (grows to _size)
        self._chain: list[int] = []  # previous position with the same bigram hash, at j % _csize
        hsize = 1 << max(4, (self._csize - 1).bit_length())  # load <= 1 over the window
        self._mask = hsize - 1
        self._head = [_FAR] * hsize
        self._cands: dict[int, int] = {}  # candidate period -> run ending at the last token
        self._mism: dict[int, int] = {}  # near-loops: candidate period -> position of its last mismatch
        self._prev = 0  # the last token
        self.n = 0  # tokens seen
        self.hit: LoopHit | None = None

    def state_slots(self) -> int:
        """List and dict slots this detector holds (8 bytes each, plus the int objects they point to)."""
        return len(self._ring) + len(self._chain) + len(self._head) + 2 * (len(self._cands) + len(self._mism))

    def push(self, token: int) -> LoopHit | None:
        """Add one token; returns the hit on the token where a loop is first detected, else None."""
        return self.extend((token,))

    def extend(self, tokens: Iterable[int]) -> LoopHit | None:
        """Add tokens in order; the hit on the token where a loop is first detected, else None.

        Once a loop is found the detector stops: later calls add nothing and return None.
        """
        if self.hit is not None:
            return None
        ring, size = self._ring, self._size
        i, prev_tok = self.n, self._prev
        for token in tokens:
            if i < size:
                ring.append(token)
            else:
                ring[i % size] = token
            if self._cands and (hit := self._follow(i, token)) is not None:
                return hit
            if (hit := self._probe(i, token, prev_tok)) is not None:
                return hit
            prev_tok = token
            i += 1
        self.n, self._prev = i, prev_tok
        return None

    def _follow(self, i: int, token: int) -> LoopHit | None:
        """Extend each candidate period's run by the token at ``i`` (dropping those it breaks)."""
        ring, size, cands, mism, near = self._ring, self._size, self._cands, self._mism, self.changes
        dead = []
        for p, run in cands.items():
            if ring[(i - p) % size] == token:
                run += 1
            elif near and i - mism.get(p, _FAR) >= p:
                mism[p] = i  # the one change this period may have
                run += 1
            else:
                dead.append(p)
                continue
            cands[p] = run
            if run >= self._needs[p]:
                return self._fire(i, token, p, run)
        for p in dead:
            del cands[p]
            if near:
                mism.pop(p, None)
        return None

    def _probe(self, i: int, token: int, prev_tok: int) -> LoopHit | None:
        """Index the bigram ending at ``i`` and measure the exact run back from ``i`` at each earlier
        position with the same bigram: a new candidate period, or a hit."""
        ring, size, chain, csize, head = self._ring, self._size, self._chain, self._csize, self._head
        cands, mism, needs, near = self._cands, self._mism, self._needs, self.changes
        h = (prev_tok * _MULT ^ token) & self._mask
        pos = head[h]
        head[h] = i
        if i < csize:
            chain.append(pos)
        else:
            chain[i % csize] = pos
        hops = 0
        while i - pos <= self.max_period:
            d = i - pos
            if d not in cands and ring[pos % size] == token and pos and ring[(pos - 1) % size] == prev_tok:
                # t[i-1..i] == t[i-1-d..i-d]: measure the exact run back from i (the ring holds every
                # position the threshold needs: run + d < size).
                need = needs[d]
                limit = min(need, i - d + 1)
                run, j = 2, i - 2
                while run < limit and ring[j % size] == ring[(j - d) % size]:
                    run += 1
                    j -= 1
                if run >= need:
                    return self._fire(i, token, d, run)
                if run >= _MIN_RUN:
                    if len(cands) >= MAX_CANDIDATES:
                        worst = min(cands, key=cands.__getitem__)
                        del cands[worst]
                        mism.pop(worst, None)
                    cands[d] = run
                    if near:
                        mism[d] = i - run  # where the exact run stopped: this period's change
            hops += 1
            if hops == MAX_CHAIN:
                break
            pos = chain[pos % csize]
        return None

    def _fire(self, i: int, token: int, p: int, run: int) -> LoopHit:
        self.n, self._prev = i + 1, token
        span = run + p
        changes = 0
        if self.changes:
            ring, size = self._ring, self._size
            changes = sum(ring[j % size] != ring[(j - p) % size] for j in range(i - run + 1, i + 1))
        self.hit = LoopHit(at=i, period=p, repeats=span // p, span=span, changes=changes)
        return self.hit


@functools.cache
def _needs(
    max_period: int, min_repeats: int, min_span_tokens: int, min_period: int = 1, confirm_tokens: int = 0
) -> tuple[int, ...]:
    """The run needed to fire, per period: span >= min_repeats * p + confirm_tokens and
    span >= min_span_tokens.

    Shared by every detector with the same settings (one per live request: building it per request
    cost more than the request's own tokens). Periods under ``min_period`` can never fire."""
    never = 1 << 62
    return (
        never,
        *(
            max(min_repeats * p + confirm_tokens, min_span_tokens) - p if p >= min_period else never
            for p in range(1, max_period + 1)
        ),
    )


def _py_extend_many(detectors: Sequence[Any], counts: Sequence[int], tokens: Iterable[int]) -> list[int]:
    """Feed ``detectors[k]`` the next ``counts[k]`` ids of the flat ``tokens``, in order, in one call (the
    rule engine's path: one call per ingest group); the indices of the detectors that fired during this
    call. A detector that had fired before gets nothing, as with ``extend``. The counts are checked
    before any detector is fed. ``extend_many`` is the compiled one (it also checks every id first, and
    takes compiled detectors only, loop and paraphrase ones); this is the fallback without the
    extension."""
    if not isinstance(detectors, list | tuple):
        raise TypeError(f"detectors must be a list, got {type(detectors).__name__}")
    if not isinstance(counts, list | tuple):
        raise TypeError(f"counts must be a list, got {type(counts).__name__}")
    tokens = list(tokens)
    if len(counts) != len(detectors):
        raise ValueError(f"{len(detectors)} detectors but {len(counts)} counts")
    for k, c in enumerate(counts):
        if not isinstance(c, int):
            raise TypeError(f"counts[{k}] must be an int, got {type(c).__name__}")
        if c < 0:
            raise ValueError(f"counts[{k}] is negative ({c})")
    if sum(counts) != len(tokens):
        raise ValueError(f"counts sum to {sum(counts)} but there are {len(tokens)} tokens")
    fired, off = [], 0
    for k, (d, c) in enumerate(zip(detectors, counts, strict=True)):
        if c and d.hit is None and d.extend(tokens[off : off + c]) is not None:
            fired.append(k)
        off += c
    return fired


COMPILED: bool
if TYPE_CHECKING:
    from ledger.rules._loopc import LoopDetector, extend_many
else:
    try:
        from ledger.rules._loopc import LoopDetector, extend_many
    except ImportError:  # built without its extension: the reference (about 30x the cost per token)
        LoopDetector, extend_many = PyLoopDetector, _py_extend_many
        COMPILED = False
    else:
        COMPILED = True


def exact_detector(settings: Any) -> LoopDetector:
    """A detector for the ``loop`` rule's settings (``ledger.rules.policy.LoopSettings``)."""
    return LoopDetector(
        max_period=settings.max_period,
        min_repeats=settings.min_repeats,
        min_span_tokens=settings.min_span_tokens,
        confirm_tokens=settings.confirm_tokens,
    )


def near_detector(settings: Any) -> LoopDetector:
    """A detector for the ``near_loop`` rule's settings (``ledger.rules.policy.NearLoopSettings``)."""
    return LoopDetector(
        max_period=settings.max_period,
        min_repeats=settings.min_repeats,
        min_span_tokens=settings.min_span_tokens,
        min_period=settings.min_period,
        changes=1,
    )


def find_loop(
    tokens: Iterable[int],
    *,
    max_period: int,
    min_repeats: int,
    min_span_tokens: int,
    min_period: int = 1,
    changes: int = 0,
    confirm_tokens: int = 0,
) -> LoopHit | None:
    """Run a fresh detector over a whole output: where it would have cut, or None."""
    det = LoopDetector(
        max_period=max_period,
        min_repeats=min_repeats,
        min_span_tokens=min_span_tokens,
        min_period=min_period,
        changes=changes,
        confirm_tokens=confirm_tokens,
    )
    return det.extend(tokens)
