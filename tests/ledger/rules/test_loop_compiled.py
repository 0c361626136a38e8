"""The compiled loop detector (``ledger.rules._loopc``) gives the pure-Python reference's answers: the
same hit (every field) and ``n`` on the shipped corpus and on random streams, in any split; ``extend_many``
equals each detector's ``extend``; bad input raises and changes nothing; a short answer stays small."""

from __future__ import annotations

import array
import itertools
import random
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.rules import loop
from ledger.rules.policy import LoopSettings, NearLoopSettings
from tools.loop_corpus import legit_corpus, loop_corpus, near_loop_corpus

D = LoopSettings()
NEAR = NearLoopSettings(enabled=True)
EXACT_KW = {
    "max_period": D.max_period,
    "min_repeats": D.min_repeats,
    "min_span_tokens": D.min_span_tokens,
    "confirm_tokens": D.confirm_tokens,
}
NEAR_KW = {
    "max_period": NEAR.max_period,
    "min_repeats": NEAR.min_repeats,
    "min_span_tokens": NEAR.min_span_tokens,
    "min_period": NEAR.min_period,
    "changes": 1,
}


def test_the_compiled_detector_is_built_and_is_the_live_one():
    """Fails when the extension did not build (the ledger would silently run the 30x slower one)."""
    from ledger.rules import _loopc

    assert loop.COMPILED is True
    assert loop.LoopDetector is _loopc.LoopDetector and loop.extend_many is _loopc.extend_many
    assert loop.PyLoopDetector is not loop.LoopDetector
    assert isinstance(loop.exact_detector(D), _loopc.LoopDetector)
    assert isinstance(loop.near_detector(NEAR), _loopc.LoopDetector)
    assert (_loopc.MAX_CANDIDATES, _loopc.MAX_CHAIN) == (loop.MAX_CANDIDATES, loop.MAX_CHAIN)


def _pair(**kw):
    return loop.PyLoopDetector(**kw), loop.LoopDetector(**kw)


def _same_state(py, c):
    """The compiled detector's debug views hold the Python detector's private fields' contents."""
    assert c.n == py.n and c._prev == py._prev
    assert c._ring == py._ring and c._chain == py._chain and c._head == py._head
    assert list(c._cands.items()) == list(py._cands.items())  # insertion order too (evictions)
    assert c._mism == py._mism


def _feed(det, tokens, group):
    hits = [det.extend(tokens[k : k + group]) for k in range(0, len(tokens), group)]
    return [h for h in hits if h is not None]


@pytest.fixture(scope="module")
def corpus():
    return legit_corpus() + loop_corpus() + near_loop_corpus()


@pytest.mark.parametrize("kw", [EXACT_KW, NEAR_KW], ids=["loop", "near_loop"])
def test_same_hits_on_the_whole_corpus_in_chunks_of_16(corpus, kw):
    fired = 0
    for s in corpus:
        py, c = _pair(**kw)
        hp, hc = _feed(py, s.tokens, 16), _feed(c, s.tokens, 16)
        assert hc == hp and c.hit == py.hit and c.n == py.n, s.id
        assert (c.hit is None) or type(c.hit) is loop.LoopHit
        fired += c.hit is not None
    assert fired >= 300  # the loops are cut (the corpus's own figures are in test_loop.py)


@pytest.mark.parametrize("kw", [EXACT_KW, NEAR_KW], ids=["loop", "near_loop"])
def test_same_hits_and_state_token_by_token(corpus, kw):
    for s in corpus[::25]:
        py, c = _pair(**kw)
        for t in s.tokens:
            hp, hc = py.push(t), c.push(t)
            assert hc == hp, s.id
            if hp is not None:
                assert c.hit is hc  # the same object as the attribute
                break
        assert c.n == py.n and c.hit == py.hit
        if py.hit is None:
            _same_state(py, c)


settings_st = st.integers(1, 24).flatmap(
    lambda mp: st.fixed_dictionaries(
        {
            "max_period": st.just(mp),
            "min_period": st.integers(1, mp),
            "min_repeats": st.integers(2, 6),
            "min_span_tokens": st.integers(2, 48),
            "changes": st.integers(0, 1),
            "confirm_tokens": st.integers(0, 20),
        }
    )
)


@st.composite
def streams(draw):
    """Random text over 1-6 symbols, or blocks repeated with now and then a changed or extra token: loops,
    near-loops, many candidates at once (evictions) and dying ones."""
    alpha = draw(st.integers(1, 6))
    sym = st.integers(0, alpha - 1)
    if draw(st.booleans()):
        return draw(st.lists(sym, max_size=300))
    out: list[int] = []
    blocks = st.tuples(st.lists(sym, min_size=1, max_size=12), st.integers(1, 8), st.lists(sym))
    for block, reps, noise in draw(st.lists(blocks, max_size=8)):
        for _ in range(reps):
            out += block
            if noise and draw(st.booleans()):
                out.append(noise[0])
    return out[:400]


def _check_random(kw, tokens, cuts):
    py, c = _pair(**kw)
    bounds = [0, *sorted(cuts), len(tokens)]
    for a, b in itertools.pairwise(bounds):
        hp, hc = py.extend(tokens[a:b]), c.extend(tokens[a:b])
        assert hc == hp and c.n == py.n
        if py.hit is None:
            assert list(c._cands.items()) == list(py._cands.items()) and c._mism == py._mism
    assert c.hit == py.hit
    return py, c


@settings(max_examples=600, deadline=None)
@given(settings_st, streams(), st.lists(st.integers(0, 400), max_size=6))
def test_random_streams_small_alphabets_any_split(kw, tokens, cuts):
    py, c = _check_random(kw, tokens, [x for x in cuts if x <= len(tokens)])
    if py.hit is None:
        _same_state(py, c)


def _seeded_streams(rng, count, kinds=(2, 3, 4, 6, 10, 50)):
    """Random settings and streams of repeated blocks with changed and extra tokens (or plain random text):
    candidates are made, die and are evicted, near-loop changes are spent."""
    for _ in range(count):
        alpha, mp = rng.choice(kinds), rng.randint(1, 24)
        kw = {
            "max_period": mp,
            "min_repeats": rng.randint(2, 8),
            "min_span_tokens": rng.randint(2, 80),
            "min_period": rng.randint(1, mp),
            "changes": rng.randint(0, 1),
            "confirm_tokens": rng.choice((0, 0, 1, 5, 16)),
        }
        tokens: list[int] = []
        if rng.random() < 0.3:
            tokens = [rng.randrange(alpha) for _ in range(rng.randint(0, 300))]
        while len(tokens) < 300:
            block = [rng.randrange(alpha) for _ in range(rng.randint(1, 25))]
            for _ in range(rng.randint(1, 8)):
                rep = list(block)
                if rng.random() < 0.5:
                    rep[rng.randrange(len(rep))] = rng.randrange(alpha)
                if rng.random() < 0.1:
                    rep.append(rng.randrange(alpha))
                tokens += rep
        yield kw, tokens


def _agree_step_by_step(kw, tokens, step=7):
    """Both detectors fed the same chunks: the same hits, n and candidates (in order) after every one;
    returns (the Python detector, chunks after which its candidate table was full and took a new one)."""
    py, c = _pair(**kw)
    evicted = 0
    for k in range(0, len(tokens), step):
        before = set(py._cands)
        assert c.extend(tokens[k : k + step]) == py.extend(tokens[k : k + step]), (kw, tokens)
        if py.hit is not None:
            break
        assert c.n == py.n and list(c._cands.items()) == list(py._cands.items()) and c._mism == py._mism
        evicted += len(before) == loop.MAX_CANDIDATES and bool(set(py._cands) - before)
    assert c.hit == py.hit and c.n == py.n
    return py, evicted


def test_seeded_random_streams_agree():
    fired = 0
    for kw, tokens in _seeded_streams(random.Random(2024), 2000):
        py, _ = _agree_step_by_step(kw, tokens)
        fired += py.hit is not None
    assert 200 < fired < 1800


@pytest.fixture
def limits(request, monkeypatch):
    """A smaller candidate table or a longer chain walk in both detectors (the Python one reads the
    module's constants as it runs, the compiled one takes them when it is made)."""
    from ledger.rules import _loopc

    cands, chain = request.param
    monkeypatch.setattr(loop, "MAX_CANDIDATES", cands)
    monkeypatch.setattr(loop, "MAX_CHAIN", chain)
    old = _loopc._set_limits(cands, chain)
    yield
    _loopc._set_limits(*old)


@pytest.mark.parametrize("limits", [(1, 1), (2, 2), (3, 2), (2, 5), (8, 6)], indirect=True)
def test_evictions_and_longer_chain_walks_agree(limits):
    """Eight candidates at once are rare (never on the corpus): with a smaller table evictions happen
    all the time, and the compiled detector evicts the same one (the smallest run, the oldest on a tie)."""
    evicted = 0
    for kw, tokens in _seeded_streams(random.Random(loop.MAX_CANDIDATES), 300, kinds=(2, 3, 4)):
        evicted += _agree_step_by_step(kw, tokens)[1]
    assert evicted > (100 if loop.MAX_CANDIDATES < 8 else -1)


@pytest.fixture
def rebase_often():
    """Rebase stored positions every few tokens (2**31 in production) to check the rebase itself."""
    from ledger.rules import _loopc

    old = _loopc._set_rebase_span(16)
    yield
    _loopc._set_rebase_span(old)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(settings_st, streams(), st.lists(st.integers(0, 400), max_size=6))
def test_random_streams_across_position_rebases(rebase_often, kw, tokens, cuts):
    py, c = _check_random(kw, tokens, [x for x in cuts if x <= len(tokens)])
    if py.hit is None:
        assert c._ring == py._ring
        # stale positions (beyond max_period) read as "none" after a rebase; the live ones are the same
        live = [p if c.n - p <= kw["max_period"] + 1 else None for p in py._head]
        assert [p if c.n - p <= kw["max_period"] + 1 else None for p in c._head] == live


def test_a_long_random_output_with_rebases_matches(rebase_often):
    rng = random.Random(11)
    tokens = [rng.randrange(5) for _ in range(20_000)]
    kw = {"max_period": 40, "min_repeats": 30, "min_span_tokens": 300}
    _check_random(kw, tokens, list(range(0, 20_000, 997)))


def test_inputs_of_every_kind_give_the_same_answer():
    tokens = [5, 6, 7, 8] * 3 + [1, 2, 3] * 40
    want = loop.PyLoopDetector(**EXACT_KW).extend(tokens)
    assert want is not None
    for given_ in (
        tokens,
        tuple(tokens),
        iter(tokens),
        (t for t in tokens),
        array.array("q", tokens),
        array.array("I", tokens),
        array.array("B", tokens),
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint32),
        np.array(tokens, dtype=np.int16),
        np.array(tokens, dtype=np.int64)[::1],
        np.repeat(np.array(tokens, dtype=np.int64), 2)[::2],  # strided: iterated
        memoryview(array.array("i", tokens)),
        bytes(tokens),
        [np.int64(t) for t in tokens],
        [bool(t) if t == 1 else t for t in tokens],
    ):
        assert loop.LoopDetector(**EXACT_KW).extend(given_) == want, type(given_)


def test_after_the_hit_nothing_more_is_taken():
    c = loop.LoopDetector(max_period=4, min_repeats=3, min_span_tokens=6)
    hit = c.extend([9, 1, 2] * 10)
    assert hit is not None and c.hit is hit and c.n == hit.at + 1
    assert c.extend([1, 2, 3]) is None and c.push(4) is None and c.n == hit.at + 1
    assert c.extend([-1, "not even checked"]) is None  # as the Python detector: it stopped
    assert loop.extend_many([c], [2], [1, 2]) == [] and c.n == hit.at + 1


def test_public_attributes_are_the_settings_and_read_only():
    py, c = _pair(**NEAR_KW)
    for name in (
        "max_period",
        "min_period",
        "min_repeats",
        "min_span_tokens",
        "changes",
        "confirm_tokens",
        "n",
        "hit",
    ):
        assert getattr(c, name) == getattr(py, name), name
        with pytest.raises(AttributeError):
            setattr(c, name, 3)
    d = loop.LoopDetector(max_period=7, min_repeats=3, min_span_tokens=9)
    assert (d.min_period, d.changes, d.confirm_tokens, d.n, d.hit) == (1, 0, 0, 0, None)


# -- extend_many ------------------------------------------------------------------------------------


def _fleet(rng, n):
    kws = [
        {
            "max_period": rng.randint(1, 12),
            "min_repeats": rng.randint(2, 5),
            "min_span_tokens": rng.randint(2, 30),
            "confirm_tokens": rng.choice((0, 3, 16)),
        }
        for _ in range(n)
    ]
    for kw in kws:
        if rng.random() < 0.3:
            kw.update(changes=1, min_period=rng.randint(1, kw["max_period"]))
    return kws


@pytest.mark.parametrize("seed", range(4))
def test_extend_many_equals_each_detectors_extend(seed):
    rng = random.Random(seed)
    kws = _fleet(rng, 60)
    many = [loop.LoopDetector(**kw) for kw in kws]
    one = [loop.LoopDetector(**kw) for kw in kws]
    ref = [loop.PyLoopDetector(**kw) for kw in kws]
    order = [*range(60), 3, 3, 7]  # the same detector twice in one call: fed in order
    fed_after_hit = 0
    for _ in range(40):
        counts = [rng.choice((0, 0, 1, 2, 3, 4, 9)) for _ in order]
        flat = [rng.randrange(rng.choice((2, 2, 3, 50))) for _ in range(sum(counts))]
        fed_after_hit += sum(1 for k, c in zip(order, counts, strict=True) if c and many[k].hit is not None)
        got = loop.extend_many([many[k] for k in order], counts, flat)
        want, off = [], 0
        for j, (k, c) in enumerate(zip(order, counts, strict=True)):
            if one[k].extend(flat[off : off + c]) is not None:
                want.append(j)
            off += c
        assert got == want
        assert loop._py_extend_many([ref[k] for k in order], counts, flat) == want
        for m, o, r in zip(many, one, ref, strict=True):
            assert m.n == o.n == r.n and m.hit == o.hit == r.hit
    assert sum(d.hit is not None for d in many) >= 5 and fed_after_hit >= 20  # they get nothing more


def test_extend_many_of_nothing():
    assert loop.extend_many([], [], []) == []
    d = loop.LoopDetector(**EXACT_KW)
    assert loop.extend_many([d, d], [0, 0], []) == [] and d.n == 0


BAD_MANY = [
    ("detectors", lambda d: ((d,), [1], [1]), None),  # a tuple is fine
    ("not a list", lambda d: (iter([d]), [1], [1]), TypeError),
    ("counts not a list", lambda d: ([d], 1, [1]), TypeError),
    ("more counts", lambda d: ([d], [1, 0], [1]), ValueError),
    ("sum too small", lambda d: ([d], [1], [1, 2]), ValueError),
    ("sum too large", lambda d: ([d], [3], [1, 2]), ValueError),
    ("negative count", lambda d: ([d, d], [3, -1], [1, 2]), ValueError),
    ("float count", lambda d: ([d], [1.0], [1]), TypeError),
    ("huge count", lambda d: ([d, d], [2**62, 2**62], [1]), ValueError),
    ("count overflow", lambda d: ([d], [2**70], [1]), OverflowError),
    ("python detector", lambda d: ([d, loop.PyLoopDetector(**EXACT_KW)], [1, 1], [1, 2]), TypeError),
    ("not a detector", lambda d: ([d, None], [1, 0], [1]), TypeError),
    ("negative token", lambda d: ([d], [2], [1, -2]), ValueError),
    ("token too large", lambda d: ([d], [2], [1, 2**31]), ValueError),
    ("str token", lambda d: ([d], [2], [1, "2"]), TypeError),
    ("tokens not iterable", lambda d: ([d], [2], 7), TypeError),
]


@pytest.mark.parametrize(("name", "args", "exc"), BAD_MANY, ids=[b[0] for b in BAD_MANY])
def test_extend_many_bad_input_raises_and_feeds_nobody(name, args, exc):
    d = loop.LoopDetector(**EXACT_KW)
    d.extend([4, 5, 6])
    if exc is None:
        assert loop.extend_many(*args(d)) == [] and d.n == 4
        return
    with pytest.raises(exc):
        loop.extend_many(*args(d))
    assert d.n == 3  # checked before anything is fed
    assert d.extend([7, 4, 5, 6, 7]) is None and d.n == 8  # and it goes on as before


@pytest.mark.parametrize(
    ("ndet", "counts", "tokens", "exc"),
    [
        (1, [1, 0], [1], ValueError),
        (1, [3], [1, 2], ValueError),
        (2, [3, -1], [1, 2], ValueError),
        (1, [1.0], [1], TypeError),
    ],
)
def test_the_python_fallback_checks_counts_as_the_compiled_one(ndet, counts, tokens, exc):
    py, c = _pair(**EXACT_KW)
    with pytest.raises(exc) as want:
        loop._py_extend_many([py] * ndet, counts, tokens)
    with pytest.raises(exc) as got:
        loop.extend_many([c] * ndet, counts, tokens)
    assert str(got.value) == str(want.value) and py.n == c.n == 0


# -- bad input to a detector -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "exc"),
    [
        (-1, ValueError),
        (2**31, ValueError),
        (2**64, ValueError),
        (-(2**70), ValueError),
        ("7", TypeError),
        (7.0, TypeError),
        (None, TypeError),
        (np.float64(3), TypeError),
    ],
)
def test_bad_token_ids_raise_and_add_nothing(token, exc):
    d = loop.LoopDetector(max_period=4, min_repeats=3, min_span_tokens=6)
    d.extend([1, 2, 3])
    with pytest.raises(exc, match="token ids"):
        d.push(token)
    with pytest.raises(exc, match="token ids"):
        d.extend([9, 9, 9, 9, 9, 9, 9, token])  # would fire on the 6th 9: nothing is added first
    assert d.n == 3 and d.hit is None
    assert d.extend([1, 2, 3]) is None and d.n == 6  # and it goes on as before


def test_bad_buffers_raise_and_add_nothing():
    d = loop.LoopDetector(**EXACT_KW)
    for bad in (
        np.array([1, -1], dtype=np.int64),
        np.array([1, 2**31], dtype=np.uint64),
        array.array("q", [5, -3]),
        np.array([1.0, 2.0]),
        np.array([[1, 2], [3, 4]]),
        "abc",
        5,
    ):
        with pytest.raises((ValueError, TypeError)):
            d.extend(bad)
    assert d.n == 0
    assert d.extend(np.array([0, 2**31 - 1], dtype=np.uint64)) is None and d.n == 2


@pytest.mark.parametrize(
    "kw",
    [
        {"max_period": 0, "min_repeats": 2, "min_span_tokens": 2},
        {"max_period": 4, "min_repeats": 1, "min_span_tokens": 2},
        {"max_period": 4, "min_repeats": 2, "min_span_tokens": 1},
        {"max_period": 4, "min_repeats": 2, "min_span_tokens": 2, "min_period": 0},
        {"max_period": 4, "min_repeats": 2, "min_span_tokens": 2, "min_period": 5},
        {"max_period": 4, "min_repeats": 2, "min_span_tokens": 2, "changes": 2},
        {"max_period": 4, "min_repeats": 2, "min_span_tokens": 2, "changes": -1},
        {"max_period": 4, "min_repeats": 2, "min_span_tokens": 2, "confirm_tokens": -1},
        {"max_period": 4, "min_repeats": 2, "min_span_tokens": 2, "confirm_tokens": -(2**80)},
        {"max_period": -(2**80), "min_repeats": 2, "min_span_tokens": 2},
        {"max_period": 4, "min_repeats": 2, "min_span_tokens": 2, "min_period": 2**80},
    ],
)
def test_bad_settings_raise_the_python_detectors_errors(kw):
    with pytest.raises(ValueError) as want:
        loop.PyLoopDetector(**kw)
    with pytest.raises(ValueError) as got:
        loop.LoopDetector(**kw)
    assert str(got.value) == str(want.value)


def test_missing_or_positional_settings_are_type_errors():
    with pytest.raises(TypeError):
        loop.LoopDetector(max_period=4, min_repeats=2)
    with pytest.raises(TypeError):
        loop.LoopDetector(4, 2, 2)
    with pytest.raises(TypeError):
        loop.LoopDetector(max_period=4.0, min_repeats=2, min_span_tokens=2)
    with pytest.raises(ValueError, match="compiled"):
        loop.LoopDetector(max_period=2**24 + 1, min_repeats=2, min_span_tokens=2)


def test_huge_thresholds_are_never_reached_as_in_python():
    tokens = [3] * 5000
    py, c = _pair(max_period=8, min_repeats=2**80, min_span_tokens=2)
    assert py.extend(tokens) is None and c.extend(tokens) is None and c.n == 5000
    assert c.min_repeats == 2**80 and c._ring == py._ring
    py, c = _pair(max_period=8, min_repeats=2, min_span_tokens=2, confirm_tokens=2**80)
    assert py.extend(tokens) is None and c.extend(tokens) is None and c.n == 5000
    assert c.confirm_tokens == 2**80 and c._ring == py._ring


# -- memory --------------------------------------------------------------------------------------------


def test_a_short_answer_stays_small():
    c = loop.exact_detector(D)
    c.extend(range(100, 164))
    assert c.state_slots() <= 64 + 64 + 1024 + 16  # its tokens, their chain links, the hash table
    assert sys.getsizeof(c) <= 5_500
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    dets = [loop.exact_detector(D) for _ in range(100)]
    for d in dets:
        d.extend(range(100, 164))
    per = (tracemalloc.get_traced_memory()[0] - before) / 100
    tracemalloc.stop()
    assert per < 6_000, per  # the Python detector: about 10 KiB


def test_a_long_output_is_capped_as_in_python():
    rng = random.Random(2)
    tokens = [rng.randrange(50_000) for _ in range(5_000)]
    py, c = _pair(**EXACT_KW)
    py.extend(tokens)
    c.extend(tokens)
    assert c.state_slots() == py.state_slots() == 1041 + 513 + 1024
    assert sys.getsizeof(c) <= 11_000  # 4-byte slots (the Python one holds about 70 KiB)
