"""The paraphrase-loop detector, compiled and the Python reference: equal to a from-scratch count at
every token, in any split; the same hits on the corpus; the shipped corpus's figures (no legitimate
output cut, most paraphrase loops cut, each condition needed)."""

from __future__ import annotations

import itertools
import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.rules import paraphrase
from ledger.rules.loop import LoopDetector, extend_many
from ledger.rules.paraphrase import (
    ParaphraseDetector,
    ParaphraseHit,
    PyParaphraseDetector,
    paraphrase_detector,
)
from ledger.rules.policy import ParaphraseLoopSettings
from tools.loop_corpus import legit_corpus, paraphrase_loop_corpus

P = ParaphraseLoopSettings(enabled=True)
LOOP_KW = {"max_period": 8, "min_repeats": 3, "min_span_tokens": 12}
BOTH = pytest.mark.parametrize("cls", [ParaphraseDetector, PyParaphraseDetector], ids=["compiled", "python"])


def test_the_compiled_detector_is_built_and_is_the_live_one():
    from ledger.rules import _loopc

    assert paraphrase.ParaphraseDetector is _loopc.ParaphraseDetector is not PyParaphraseDetector
    assert isinstance(paraphrase_detector(P), _loopc.ParaphraseDetector)


def brute_force_first_hit(tokens, *, ngram, min_seen, window, min_recurrent_ratio, min_jumps, min_vocabulary):
    """The detector's definition, recounted from the whole prefix at every token."""
    rec, jump, last_end = [], [], {}
    counts: dict[tuple[int, ...], int] = {}
    prev_src = -2
    for i in range(len(tokens)):
        r = j = 0
        if i >= ngram - 1:
            g = tuple(tokens[i - ngram + 1 : i + 1])
            seen, src = counts.get(g, 0), last_end.get(g, -2)
            if seen >= min_seen:
                r, j = 1, int(src != prev_src + 1)
            prev_src = src
            counts[g], last_end[g] = seen + 1, i
        rec.append(r)
        jump.append(j)
        lo = max(0, i + 1 - window)
        vocab = {tokens[k] for k in range(lo, i + 1) if rec[k]}
        if (
            sum(rec[lo:]) >= min_recurrent_ratio * window
            and sum(jump[lo:]) >= min_jumps
            and len(vocab) >= min_vocabulary
        ):
            return ParaphraseHit(i, i + 1 - lo, sum(rec[lo:]), sum(jump[lo:]), len(vocab))
    return None


small_settings = st.fixed_dictionaries(
    {
        "ngram": st.integers(1, 4),
        "min_seen": st.integers(1, 3),
        "window": st.integers(1, 24),
        "min_recurrent_ratio": st.sampled_from([0.3, 0.5, 0.8, 1.0]),
        "min_jumps": st.integers(0, 6),
        "min_vocabulary": st.integers(0, 6),
    }
)


@st.composite
def reworded(draw):
    """Phrases over a small alphabet said again in changing order: recurrence, jumps, long copies."""
    alpha = draw(st.integers(2, 12))
    phrases = draw(
        st.lists(st.lists(st.integers(0, alpha - 1), min_size=1, max_size=6), min_size=1, max_size=5)
    )
    order = draw(st.lists(st.integers(0, len(phrases) - 1), max_size=60))
    return [t for k in order for t in phrases[k]][:300]


@BOTH
@settings(max_examples=300, deadline=None)
@given(kw=small_settings, tokens=reworded(), cuts=st.lists(st.integers(0, 300), max_size=5))
def test_equals_a_count_from_scratch_in_any_split(cls, kw, tokens, cuts):
    det = cls(**kw)
    bounds = [0, *sorted(c for c in cuts if c <= len(tokens)), len(tokens)]
    hits = [det.extend(tokens[a:b]) for a, b in itertools.pairwise(bounds)]
    want = brute_force_first_hit(tokens, **kw)
    assert [h for h in hits if h is not None] == ([want] if want else [])
    assert det.hit == want and det.n == (want.at + 1 if want else len(tokens))


@BOTH
def test_after_the_hit_nothing_more_is_taken(cls):
    det = cls(ngram=1, min_seen=1, window=4, min_recurrent_ratio=1.0, min_jumps=0, min_vocabulary=1)
    hit = det.extend([5, 5, 5, 5, 5, 5, 9, 9])
    assert hit == ParaphraseHit(at=4, window=4, recurrent=4, jumps=1, vocabulary=1)
    assert det.extend([1, 2, 3]) is None and det.n == 5 and det.hit is hit


@BOTH
def test_a_block_said_again_verbatim_is_one_long_copy_not_many_jumps(cls):
    rng = random.Random(4)
    block = [rng.randrange(1000) for _ in range(80)]
    kw = {"ngram": 4, "min_seen": 2, "window": 64, "min_recurrent_ratio": 0.9, "min_vocabulary": 32}
    det = cls(min_jumps=0, **kw)
    assert det.extend(block * 5) is not None and det.hit.jumps <= 2
    assert cls(min_jumps=4, **kw).extend(block * 5) is None


@pytest.mark.parametrize(
    "kw",
    [{"ngram": 0}, {"min_seen": 0}, {"window": 0}],
)
def test_bad_settings_raise_the_same_error(kw):
    with pytest.raises(ValueError, match="at least 1") as want:
        PyParaphraseDetector(**kw)
    with pytest.raises(ValueError) as got:
        ParaphraseDetector(**kw)
    assert str(got.value) == str(want.value)


def test_bad_token_ids_raise_and_add_nothing():
    det = ParaphraseDetector()
    det.extend([1, 2, 3])
    for bad in ([4, -1], [4, 2**31], [4, "5"]):
        with pytest.raises((ValueError, TypeError)):
            det.extend(bad)
    assert det.n == 3


def test_extend_many_feeds_paraphrase_and_loop_detectors_as_their_extend():
    rng = random.Random(8)
    kw = {
        "ngram": 2,
        "min_seen": 1,
        "window": 12,
        "min_recurrent_ratio": 0.5,
        "min_jumps": 2,
        "min_vocabulary": 3,
    }
    phrases = [[rng.randrange(9) for _ in range(rng.randint(2, 5))] for _ in range(6)]
    streams = [[t for _ in range(30) for t in rng.choice(phrases)] for _ in range(20)]
    many = [d for _ in streams for d in (ParaphraseDetector(**kw), LoopDetector(**LOOP_KW))]
    one = [d for _ in streams for d in (ParaphraseDetector(**kw), LoopDetector(**LOOP_KW))]
    pos = [0] * len(streams)
    for _ in range(25):
        counts = [rng.randint(0, 4) for _ in streams]
        parts = [s[p : p + c] for s, p, c in zip(streams, pos, counts, strict=True)]
        pos = [p + c for p, c in zip(pos, counts, strict=True)]
        got = extend_many(
            many, [c for c in counts for _ in (0, 1)], [t for ids in parts for _ in (0, 1) for t in ids]
        )
        want = [k for k, d in enumerate(one) if d.hit is None and d.extend(parts[k // 2]) is not None]
        assert got == want
        assert [(m.n, m.hit) for m in many] == [(o.n, o.hit) for o in one]
    assert sum(d.hit is not None for d in many[::2]) >= 5


def test_extend_many_refuses_a_python_paraphrase_detector_and_feeds_nobody():
    d = ParaphraseDetector()
    with pytest.raises(TypeError, match="detectors\\[1\\]"):
        extend_many([d, PyParaphraseDetector()], [1, 1], [1, 2])
    assert d.n == 0


def test_memory_is_about_48_bytes_per_token_and_small_for_a_short_answer():
    rng = random.Random(3)
    short, long = ParaphraseDetector(), ParaphraseDetector()
    short.extend([rng.randrange(50_000) for _ in range(64)])
    long.extend([rng.randrange(50_000) for _ in range(16_384)])
    assert sys.getsizeof(short) <= 10_000
    assert sys.getsizeof(long) <= 16_384 * 50


# -- the shipped corpus (python -m bench.loopdetect prints the same figures) ---------------------------


@pytest.fixture(scope="module")
def legit():
    return legit_corpus()


def test_compiled_and_python_give_the_same_hits_on_the_corpus_in_chunks_of_16(legit):
    fired = 0
    for s in legit[::3] + paraphrase_loop_corpus()[::2]:
        c, py = paraphrase_detector(P), PyParaphraseDetector(**P.model_dump(exclude={"enabled"}))
        for k in range(0, len(s.tokens), 16):
            assert c.extend(s.tokens[k : k + 16]) == py.extend(s.tokens[k : k + 16]), s.id
        assert c.hit == py.hit and c.n == py.n, s.id
        fired += c.hit is not None
    assert fired >= 40


def test_corpus_legit_outputs_are_never_cut(legit):
    assert [s.id for s in legit if paraphrase_detector(P).extend(s.tokens)] == []


def test_corpus_paraphrase_loops_are_mostly_cut_never_before_they_start():
    loops = paraphrase_loop_corpus()
    hits = [(s, paraphrase_detector(P).extend(s.tokens)) for s in loops]
    assert all(h.at >= s.onset for s, h in hits if h is not None)
    assert sum(h is not None for _, h in hits) >= 0.8 * len(loops)  # 100 of 120


@pytest.mark.parametrize(
    ("change", "cut"),
    [
        ({"min_jumps": 16}, ["legit-prose-6"]),  # sentences of a small pool said again, in turn
        ({"min_seen": 2}, ["legit-shown-twice-3"]),  # one code block shown four times
        (
            {"min_vocabulary": 48},
            ["legit-shown-twice-0", "legit-shown-twice-3", "legit-shown-twice-6", "legit-shown-twice-9"],
        ),
    ],
)
def test_each_condition_is_needed_on_the_corpus(legit, change, cut):
    looser = P.model_copy(update=change)
    assert [s.id for s in legit if paraphrase_detector(looser).extend(s.tokens)] == cut
