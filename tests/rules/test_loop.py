"""The loop detector: exact detection point, bounded memory, the corpus, and ``chunkledger loopcheck``."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.rules.corpus import legit_corpus, loop_corpus, tokenize
from ledger.rules.loop import LoopDetector, find_loop
from ledger.rules.policy import LoopSettings

D = LoopSettings()


def brute_force_first_hit(tokens, max_period, min_repeats, min_span):
    """Reference: the first index where some period's tail satisfies both thresholds (O(n*K))."""
    runs = [0] * (max_period + 1)
    for i in range(len(tokens)):
        for p in range(1, max_period + 1):
            runs[p] = runs[p] + 1 if i >= p and tokens[i] == tokens[i - p] else 0
            if runs[p] >= (min_repeats - 1) * p and runs[p] + p >= min_span:
                return i
    return None


def test_fires_on_the_token_that_completes_the_repeats():
    prefix = tokenize("Here is the answer you asked for, with a short note first.")
    block = [11, 22, 33, 44, 55]
    tokens = prefix + block * 40
    hit = find_loop(tokens, max_period=8, min_repeats=4, min_span_tokens=20)
    assert hit is not None and hit.period == 5
    assert hit.at == len(prefix) + 4 * 5 - 1  # the last token of the 4th repeat


def test_span_threshold_holds_short_periods_back():
    tokens = [9] * 200
    hit = find_loop(tokens, max_period=8, min_repeats=4, min_span_tokens=50)
    assert hit is not None and hit.period == 1 and hit.at == 49


def test_never_fires_before_the_reference_and_never_misses(request):
    rng = random.Random(3)
    for _ in range(200):
        p = rng.randint(1, 12)
        block = [rng.randint(0, 5) for _ in range(p)]  # a small alphabet: lots of internal repetition
        tokens = [rng.randint(0, 5) for _ in range(rng.randint(0, 60))] + block * rng.randint(1, 30)
        ref = brute_force_first_hit(tokens, 12, 3, 10)
        hit = find_loop(tokens, max_period=12, min_repeats=3, min_span_tokens=10)
        if ref is None:
            assert hit is None
        else:
            # Candidates are found from repeated bigrams, so the detector can be a little late (never
            # early, never wrong): at most one extra period plus the bigram.
            assert hit is not None and ref <= hit.at <= ref + 12 + 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=400))
def test_any_hit_is_a_real_periodic_tail(tokens):
    hit = find_loop(tokens, max_period=16, min_repeats=3, min_span_tokens=8)
    if hit is not None:
        i, p = hit.at, hit.period
        tail = tokens[i - hit.span + 1 : i + 1]
        assert len(tail) == hit.span >= 8 and hit.span >= 3 * p
        assert all(tail[j] == tail[j - p] for j in range(p, len(tail)))


def test_memory_stays_bounded_on_long_outputs():
    d = LoopDetector(max_period=64, min_repeats=4, min_span_tokens=128)
    rng = random.Random(1)
    d.extend(rng.randrange(50_000) for _ in range(200_000))
    assert d.hit is None
    assert len(d._ring) == 64 + 3 and len(d._last) <= 4 * (64 + 3) and len(d._cands) <= 8


def test_corpus_legit_repetition_is_never_cut_with_the_defaults():
    flagged = [
        s.id
        for s in legit_corpus()
        if find_loop(
            s.tokens, max_period=D.max_period, min_repeats=D.min_repeats, min_span_tokens=D.min_span_tokens
        )
    ]
    assert flagged == []


def test_corpus_loops_are_cut_within_a_few_periods_or_the_span():
    loops = loop_corpus(max_period=D.max_period)
    assert {s.period for s in loops} == set(range(1, D.max_period + 1))
    for s in loops:
        hit = find_loop(
            s.tokens, max_period=D.max_period, min_repeats=D.min_repeats, min_span_tokens=D.min_span_tokens
        )
        assert hit is not None, s.id
        delay = hit.at - s.onset + 1
        assert delay >= 0, s.id
        # the thresholds themselves, plus at most one period and the bigram for late discovery
        bound = max(D.min_repeats * s.period, D.min_span_tokens) + s.period + 2
        assert delay <= bound, (s.id, delay, bound)


def test_the_thresholds_are_needed_lower_span_would_cut_legit_tables():
    """The corpus is what fixes the defaults: a span of 64 would cut legitimate outputs."""
    flagged = [
        s.id for s in legit_corpus() if find_loop(s.tokens, max_period=64, min_repeats=4, min_span_tokens=64)
    ]
    assert flagged


def _run_loopcheck(tmp_path, lines, *args):
    f = tmp_path / "outputs.jsonl"
    f.write_text("".join(lines))
    return subprocess.run(
        [sys.executable, "-m", "ledger.cli", "loopcheck", str(f), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_loopcheck_cli_prints_one_json_line_per_output(tmp_path):
    loop = [1, 2, 3] + [7, 8] * 100
    lines = [
        json.dumps({"id": "ok", "tokens": tokenize("A perfectly normal answer.")}) + "\n",
        json.dumps({"id": 42, "tokens": loop}) + "\n",
    ]
    proc = _run_loopcheck(tmp_path, lines)
    assert proc.returncode == 0, proc.stderr
    out = [json.loads(x) for x in proc.stdout.splitlines()]
    want = find_loop(loop, max_period=64, min_repeats=4, min_span_tokens=128)
    assert out == [
        {"id": "ok", "loop": False, "at": None, "period": None},
        {"id": 42, "loop": True, "at": want.at, "period": 2},
    ]


def test_loopcheck_uses_the_policy_file_settings_per_model(tmp_path):
    pol = tmp_path / "policy.toml"
    pol.write_text('[models."small".rules.loop]\nmin_span_tokens = 20\nmin_repeats = 2\n')
    line = json.dumps({"id": "x", "tokens": [5, 6] * 12}) + "\n"
    default = json.loads(_run_loopcheck(tmp_path, [line], "--policy", str(pol)).stdout)
    small = json.loads(_run_loopcheck(tmp_path, [line], "--policy", str(pol), "--model", "small").stdout)
    assert default["loop"] is False
    assert small == {"id": "x", "loop": True, "at": 19, "period": 2}


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"id": 1, "tokens": [1, "a"]}', "field tokens"),
        ('{"tokens": [1]}', "field id"),
        ("not json", "line"),
    ],
)
def test_loopcheck_reports_bad_lines_with_line_number_and_exits_1(tmp_path, line, reason):
    proc = _run_loopcheck(tmp_path, ['{"id": 0, "tokens": []}\n', line + "\n"])
    assert proc.returncode == 1
    assert ":2:" in proc.stderr and reason in proc.stderr
    assert json.loads(proc.stdout.splitlines()[0]) == {"id": 0, "loop": False, "at": None, "period": None}


def test_loopcheck_bad_policy_exits_2_naming_the_field(tmp_path):
    pol = tmp_path / "policy.toml"
    pol.write_text("[rules.loop]\nmax_period = -3\n")
    proc = _run_loopcheck(tmp_path, ['{"id": 0, "tokens": []}\n'], "--policy", str(pol))
    assert proc.returncode == 2 and "rules.loop.max_period" in proc.stderr
