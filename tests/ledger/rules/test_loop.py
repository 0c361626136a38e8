"""The loop detectors: exact detection point, near-loops, bounded memory, the shipped corpus's figures,
vLLM's rule side by side, and ``chunkledger loopcheck``."""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.loopdetect import brute_force_first_hit, vllm_rule
from ledger.rules.loop import exact_detector, find_loop, near_detector
from ledger.rules.paraphrase import paraphrase_detector
from ledger.rules.policy import LoopSettings, NearLoopSettings, ParaphraseLoopSettings
from tools.loop_corpus import legit_corpus, loop_corpus, near_loop_corpus, paraphrase_loop_corpus, tokenize

D = LoopSettings()
NEAR = NearLoopSettings(enabled=True)


@pytest.fixture(scope="module")
def legit():
    return legit_corpus()


@pytest.fixture(scope="module")
def loops():
    return loop_corpus()


def _first(make, s):
    h = make().extend(s.tokens)
    return h.at if h else None


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


def test_a_512_token_block_is_cut_16_tokens_past_its_second_repeat():
    rng = random.Random(5)
    prefix = [rng.randrange(50_000) for _ in range(3000)]
    block = [rng.randrange(50_000) for _ in range(512)]
    hit = exact_detector(D).extend(prefix + block * 4)
    assert hit is not None and hit.period == 512 and hit.at == 3000 + 2 * 512 + 16 - 1


@pytest.mark.parametrize("p", [1, 2, 7, 23, 24, 25, 40, 100])
def test_a_loop_must_span_64_tokens_or_two_periods_and_16(p):
    """The span rule: max(64, 2p + 16) tokens, a confirmation past the second repeat."""
    rng = random.Random(p)
    block = [rng.randrange(1000, 50_000) for _ in range(p)] if p > 1 else [7]
    prefix = tokenize("Here is the answer you asked for, with a short note first.")
    hit = exact_detector(D).extend(prefix + block * (200 // p + 4))
    assert hit is not None and hit.period == p
    assert hit.at - len(prefix) + 1 == hit.span == max(64, 2 * p + 16)


def test_equals_the_brute_force_on_small_alphabets():
    """Blocks over 3-6 symbols repeat their own bigrams: the hash chain still finds the period, on the
    exact token where checking every period at every token would."""
    rng = random.Random(3)
    for _ in range(300):
        alpha, p = rng.choice((3, 6, 50)), rng.randint(1, 40)
        block = [rng.randint(0, alpha) for _ in range(p)]
        tokens = [rng.randint(0, alpha) for _ in range(rng.randint(0, 80))] + block * rng.randint(1, 12)
        ref = brute_force_first_hit(tokens, max_period=40, min_repeats=3, min_span_tokens=10)
        hit = find_loop(tokens, max_period=40, min_repeats=3, min_span_tokens=10)
        assert (hit.at if hit else None) == ref, tokens


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=400))
def test_any_hit_is_a_real_periodic_tail(tokens):
    hit = find_loop(tokens, max_period=16, min_repeats=3, min_span_tokens=8)
    if hit is not None:
        i, p = hit.at, hit.period
        tail = tokens[i - hit.span + 1 : i + 1]
        assert len(tail) == hit.span >= 8 and hit.span >= 3 * p
        assert all(tail[j] == tail[j - p] for j in range(p, len(tail)))
        assert hit.at >= brute_force_first_hit(tokens, max_period=16, min_repeats=3, min_span_tokens=8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=400))
def test_a_near_loop_hit_changes_at_most_one_token_per_period(tokens):
    hit = find_loop(tokens, max_period=16, min_repeats=3, min_span_tokens=12, min_period=2, changes=1)
    if hit is not None:
        i, p = hit.at, hit.period
        assert hit.span >= max(12, 3 * p) and p >= 2
        bad = [j for j in range(i - hit.span + p + 1, i + 1) if tokens[j] != tokens[j - p]]
        assert len(bad) == hit.changes
        assert all(b - a >= p for a, b in itertools.pairwise(bad))


def test_near_loop_rule_catches_a_counter_the_exact_rule_never_does():
    body = " and then we check the queue again before the next step"
    tokens = tokenize("Here is the plan." + "".join(f"\nStep {i}:{body}" for i in range(1, 60)))
    assert exact_detector(D).extend(tokens) is None
    hit = near_detector(NEAR).extend(tokens)
    assert hit is not None and hit.period == len(tokenize(f"\nStep 1:{body}")) and hit.changes >= 3


def test_memory_stays_bounded_on_long_outputs():
    d = exact_detector(D)
    rng = random.Random(1)
    d.extend(rng.randrange(50_000) for _ in range(200_000))
    assert d.hit is None
    window = max(D.min_span_tokens, D.min_repeats * D.max_period + D.confirm_tokens) + 1
    assert len(d._ring) == window and len(d._chain) == D.max_period + 1 and len(d._head) == 1024
    assert len(d._cands) <= 8 and d.state_slots() <= window + D.max_period + 1 + 1024 + 16


def test_a_short_answer_holds_only_its_own_tokens():
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    dets = [exact_detector(D) for _ in range(100)]
    for d in dets:
        d.extend(range(100, 164))
    per = (tracemalloc.get_traced_memory()[0] - before) / 100
    tracemalloc.stop()
    assert all(len(d._ring) == 64 for d in dets)
    assert per < 12_000, per  # the fixed 1,024-slot hash table (8 KiB) and 64 tokens, not the 1,537 ring


# -- the shipped corpus: the figures the defaults were chosen by (python -m bench.loopdetect) -------


def test_corpus_legit_repetition_is_never_cut_with_the_defaults(legit):
    assert [s.id for s in legit if exact_detector(D).extend(s.tokens)] == []
    assert [s.id for s in legit if near_detector(NEAR).extend(s.tokens)] == []


def test_the_span_defaults_are_the_corpus_bounds(legit):
    """A JSON flag array repeats its 30-token pattern 2.27 times (68 tokens): without the 16 tokens of
    confirmation past the second repeat (a flat 64) it is cut; arrays of zeros repeat a 2-token
    pattern over 62 tokens, so 60 would cut them."""
    flat = D.model_copy(update={"confirm_tokens": 0})
    assert [s.id for s in legit if exact_detector(flat).extend(s.tokens)] == ["legit-json-flags-3"]
    shorter = D.model_copy(update={"min_span_tokens": 60})
    assert [s.id for s in legit if exact_detector(shorter).extend(s.tokens)] == [
        "legit-json-zeros-0",
        "legit-json-zeros-6",
        "legit-json-zeros-10",
    ]


def _brute(s, settings=D):
    return brute_force_first_hit(
        s.tokens,
        max_period=settings.max_period,
        min_repeats=settings.min_repeats,
        min_span_tokens=settings.min_span_tokens,
        confirm_tokens=settings.confirm_tokens,
    )


def test_the_near_span_default_is_the_corpus_bound(legit):
    """Rows that differ in one cell (tables, a month of constant CSV, heartbeat logs, numbered blanks,
    unrolled code, hosts in the same state) are near-loops while they last: the old 128-token span cut
    every kind of them, and the longest (a one-cell table of 498 tokens) is cut by a span of 498."""
    old = NEAR.model_copy(update={"min_span_tokens": 128})
    cut = {s.id.rsplit("-", 1)[0] for s in legit if near_detector(old).extend(s.tokens)}
    assert cut == {
        "legit-one-cell-table",
        "legit-constant-csv",
        "legit-heartbeat-log",
        "legit-numbered-placeholders",
        "legit-unrolled",
        "legit-same-status",
    }
    shorter = NEAR.model_copy(update={"min_span_tokens": 498})
    assert [s.id for s in legit if near_detector(shorter).extend(s.tokens)] == ["legit-one-cell-table-9"]
    assert NEAR.min_span_tokens >= 1.5 * 498


def test_corpus_exact_loops_are_all_cut_where_the_brute_force_cuts_within_two_periods_and_64(loops):
    exact = [s for s in loops if s.kind == "exact"]
    assert {1, 512} <= {s.period for s in exact} and len(exact) >= 270
    delays = []
    for s in exact:
        at = _first(lambda: exact_detector(D), s)
        assert at == _brute(s) and at is not None and at >= s.onset, s.id
        delay = at - s.onset + 1
        assert delay <= max(D.min_span_tokens, 2 * s.period + D.confirm_tokens) <= 2 * s.period + 64, s.id
        delays.append(delay)
    assert statistics.median(delays) <= 64


def test_corpus_drifting_loops_are_all_cut_never_before_the_brute_force(loops):
    drift = [s for s in loops if s.kind == "drift"]
    assert len(drift) >= 90
    for s in drift:
        at = _first(lambda: exact_detector(D), s)
        assert at is not None and at >= _brute(s) >= s.onset, s.id


def test_corpus_near_loops_are_cut_by_the_near_rule_only():
    near = near_loop_corpus()
    assert [s.id for s in near if exact_detector(D).extend(s.tokens)] == []
    for s in near:
        at = _first(lambda: near_detector(NEAR), s)
        assert at is not None and at >= s.onset, s.id


def test_vllm_rule_here_is_vllms_own_check_sequence_repetition(legit, loops):
    utils = pytest.importorskip("vllm.v1.core.sched.utils")
    from vllm.sampling_params import RepetitionDetectionParams

    params = RepetitionDetectionParams(max_pattern_size=10, min_pattern_size=1, min_count=3)
    for s in legit[::24] + loops[::40]:
        theirs = next(
            (i for i in range(len(s.tokens)) if utils.check_sequence_repetition(s.tokens[: i + 1], params)),
            None,
        )
        assert vllm_rule(10, 1, 3)(s) == theirs, s.id


def test_beats_vllms_documented_example_on_recall_with_fewer_false_positives(legit, loops):
    theirs = vllm_rule(10, 1, 3)  # the example settings of vLLM's docs (its default is off)
    exact = [s for s in loops if s.kind == "exact"]
    their_fp = sum(theirs(s) is not None for s in legit)
    their_recall = sum((a := theirs(s)) is not None and a >= s.onset for s in exact)
    assert their_fp > 0 and their_recall < len(exact)  # cuts JSON arrays and tables, misses long blocks
    assert sum(_first(lambda: exact_detector(D), s) is not None for s in exact) == len(exact)


def _run_loopcheck(tmp_path, lines, *args):
    f = tmp_path / "outputs.jsonl"
    f.write_text("".join(lines))
    return subprocess.run(
        [sys.executable, "-m", "chunkledger", "loopcheck", str(f), *args],
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
    want = exact_detector(D).extend(loop)
    assert out == [
        {"id": "ok", "loop": False, "rule": None, "at": None, "period": None, "repeats": None, "span": None},
        {"id": 42, "loop": True, "rule": "loop", "at": want.at, "period": 2, "repeats": 32, "span": 64},
    ]


def test_loopcheck_reports_near_loops_unless_the_policy_disables_them(tmp_path):
    pol = tmp_path / "policy.toml"
    pol.write_text("[rules.near_loop]\nenabled = false\n")
    body = " and then we check the queue again before the next step"
    tokens = tokenize("".join(f"\nStep {i}:{body}" for i in range(1, 60)))
    line = json.dumps({"id": "n", "tokens": tokens}) + "\n"
    on = json.loads(_run_loopcheck(tmp_path, [line]).stdout)
    off = json.loads(_run_loopcheck(tmp_path, [line], "--policy", str(pol)).stdout)
    assert off["loop"] is False
    want = near_detector(NEAR).extend(tokens)
    assert (on["rule"], on["at"], on["period"]) == ("near_loop", want.at, want.period)


def test_loopcheck_reports_paraphrase_loops_where_the_policy_enables_them(tmp_path):
    pol = tmp_path / "policy.toml"
    pol.write_text("[rules.paraphrase_loop]\nenabled = true\n")
    loop = paraphrase_loop_corpus()[0]
    line = json.dumps({"id": "p", "tokens": loop.tokens}) + "\n"
    off = json.loads(_run_loopcheck(tmp_path, [line]).stdout)
    on = json.loads(_run_loopcheck(tmp_path, [line], "--policy", str(pol)).stdout)
    assert off["loop"] is False
    want = paraphrase_detector(ParaphraseLoopSettings()).extend(loop.tokens)
    assert on == {
        "id": "p",
        "loop": True,
        "rule": "paraphrase_loop",
        "at": want.at,
        "period": None,
        "repeats": None,
        "span": 256,
    }


def test_loopcheck_uses_the_policy_file_settings_per_model(tmp_path):
    pol = tmp_path / "policy.toml"
    pol.write_text('[models."small".rules.loop]\nmin_span_tokens = 20\nmin_repeats = 2\n')
    line = json.dumps({"id": "x", "tokens": [5, 6] * 12}) + "\n"
    default = json.loads(_run_loopcheck(tmp_path, [line], "--policy", str(pol)).stdout)
    small = json.loads(_run_loopcheck(tmp_path, [line], "--policy", str(pol), "--model", "small").stdout)
    assert default["loop"] is False
    assert small == {
        "id": "x",
        "loop": True,
        "rule": "loop",
        "at": 19,
        "period": 2,
        "repeats": 10,
        "span": 20,
    }


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
    assert json.loads(proc.stdout.splitlines()[0])["loop"] is False


def test_loopcheck_bad_policy_exits_2_naming_the_field(tmp_path):
    pol = tmp_path / "policy.toml"
    pol.write_text("[rules.loop]\nmax_period = -3\n")
    proc = _run_loopcheck(tmp_path, ['{"id": 0, "tokens": []}\n'], "--policy", str(pol))
    assert proc.returncode == 2 and "rules.loop.max_period" in proc.stderr
