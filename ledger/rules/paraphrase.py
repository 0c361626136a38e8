"""Paraphrase-loop detector: the same steps said again and again in other words (a reasoning model going
round in circles), which no periodic rule sees.

Each token ends an ``ngram``-token phrase (a 4-gram). The phrase is *recurrent* when it occurred at
least ``min_seen`` times earlier in the output, and a recurrent phrase is a *jump* when its previous
occurrence does not follow the previous phrase's (a copy switched to another place of the output). Over
the last ``window`` tokens the detector counts the recurrent phrases, the jumps, and the distinct tokens
that end a recurrent phrase (the *vocabulary* of what is said again). It fires on the first token where
all three reach their thresholds: most of the recent text is phrases said ``min_seen`` times before
(``min_recurrent_ratio``), stitched from many places (``min_jumps``: a code block shown again is one
long copy, one jump), in many words (``min_vocabulary``: a table of marks or a JSON array of flags
repeats a handful of tokens).

On the shipped corpus (``tools.loop_corpus``) the defaults cut no legitimate output and 83 % of the
paraphrase loops, about 1,400 tokens after their second round (``python -m bench.loopdetect``); the
rule is off by default. ``ParaphraseDetector`` is compiled (``ledger.rules._loopc``, beside the loop
detector; about 40 ns per token) and ``PyParaphraseDetector`` the pure-Python reference it is tested
against (about 0.6 us per token; the fallback where the extension is missing). Memory: one entry per
distinct phrase of the output (compiled, 24 bytes for a 4-token phrase in a table at most half full:
about 48 bytes per output token, 9 KiB for a 64-token answer, 0.8 MiB at 16,384 tokens) and three
rings of ``window`` slots.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

_POS = 1 << 40  # a phrase's entry: count * _POS + end position of its newest occurrence


@dataclass(frozen=True)
class ParaphraseHit:
    at: int  # index (0-based, over the whole output) of the token on which it fired
    window: int  # tokens looked at
    recurrent: int  # of them, ends of phrases said min_seen times before
    jumps: int  # recurrent phrases whose previous occurrence is elsewhere than the previous one's
    vocabulary: int  # distinct tokens ending a recurrent phrase in the window


class PyParaphraseDetector:
    """Feed output token ids in order with ``extend``; ``hit`` is set the first time it fires.

    The pure-Python reference: ``ParaphraseDetector`` (compiled) gives the same answers."""

    __slots__ = (
        "_counts",
        "_jump",
        "_key",
        "_last",
        "_mask",
        "_need",
        "_rec",
        "_seen",
        "_tok",
        "_vocab",
        "hit",
        "min_jumps",
        "min_recurrent_ratio",
        "min_seen",
        "min_vocabulary",
        "n",
        "ngram",
        "window",
    )

    def __init__(
        self,
        *,
        ngram: int = 4,
        min_seen: int = 3,
        window: int = 256,
        min_recurrent_ratio: float = 0.8,
        min_jumps: int = 24,
        min_vocabulary: int = 64,
    ) -> None:
        if ngram < 1 or min_seen < 1 or window < 1:
            raise ValueError("ngram, min_seen and window must be at least 1")
        self.ngram, self.min_seen, self.window = ngram, min_seen, window
        self.min_recurrent_ratio, self.min_jumps, self.min_vocabulary = (
            min_recurrent_ratio,
            min_jumps,
            min_vocabulary,
        )
        self._need = min_recurrent_ratio * window
        self._mask = (1 << (31 * ngram)) - 1
        self._key = 0  # the phrase ending at the last token: its ids, 31 bits each
        self._seen: dict[int, int] = {}  # phrase -> count * _POS + end position of its newest occurrence
        self._last = -2  # where the previous phrase occurred before (its end), -2: nowhere
        self._rec = [0] * window  # per window slot: 1 if recurrent
        self._jump = [0] * window
        self._tok = [-1] * window  # the token ending a recurrent phrase, else -1
        self._vocab: dict[int, int] = {}  # token -> recurrent phrases it ends in the window
        self.n = 0
        self.hit: ParaphraseHit | None = None
        self._counts = (0, 0)  # recurrent, jumps in the window

    def extend(self, tokens: Iterable[int]) -> ParaphraseHit | None:
        """Add tokens in order; the hit on the token where it first fires, else None (and nothing is
        added after that). One loop with its state in locals: this is the per-token cost."""
        if self.hit is not None:
            return None
        k, w, seen_min, need, min_jumps, min_vocab = (
            self.ngram,
            self.window,
            self.min_seen * _POS,
            self._need,
            self.min_jumps,
            self.min_vocabulary,
        )
        seen, vocab, rec_ring, jump_ring, tok_ring = self._seen, self._vocab, self._rec, self._jump, self._tok
        mask, key, last, i = self._mask, self._key, self._last, self.n
        recurrent, jumps = self._counts
        for token in tokens:
            key = ((key << 31) | token) & mask  # the last ngram ids, 31 bits each
            rec = jump = 0
            if i >= k - 1:
                entry = seen.get(key, -1)
                if entry < 0:
                    seen[key] = _POS + i
                    last = -2
                else:
                    prev = entry % _POS
                    seen[key] = entry - prev + _POS + i
                    if entry >= seen_min:  # said min_seen times before
                        rec = 1
                        jump = prev != last + 1
                    last = prev
            slot = i % w
            old = tok_ring[slot]
            if old >= 0:  # the token leaving the window ended a recurrent phrase
                c = vocab[old] - 1
                if c:
                    vocab[old] = c
                else:
                    del vocab[old]
            if rec:
                vocab[token] = vocab.get(token, 0) + 1
                tok_ring[slot] = token
            else:
                tok_ring[slot] = -1
            recurrent += rec - rec_ring[slot]
            jumps += jump - jump_ring[slot]
            rec_ring[slot] = rec
            jump_ring[slot] = jump
            i += 1
            if recurrent >= need and jumps >= min_jumps and len(vocab) >= min_vocab:
                self.hit = ParaphraseHit(i - 1, min(i, w), recurrent, jumps, len(vocab))
                break
        self._key, self._last, self.n, self._counts = key, last, i, (recurrent, jumps)
        return self.hit


if TYPE_CHECKING:
    from ledger.rules._loopc import ParaphraseDetector
else:
    try:
        from ledger.rules._loopc import ParaphraseDetector
    except ImportError:  # built without its extension: the reference
        ParaphraseDetector = PyParaphraseDetector


def paraphrase_detector(settings: Any) -> ParaphraseDetector:
    """A detector for the ``paraphrase_loop`` rule's settings
    (``ledger.rules.policy.ParaphraseLoopSettings``)."""
    return ParaphraseDetector(
        ngram=settings.ngram,
        min_seen=settings.min_seen,
        window=settings.window,
        min_recurrent_ratio=settings.min_recurrent_ratio,
        min_jumps=settings.min_jumps,
        min_vocabulary=settings.min_vocabulary,
    )
