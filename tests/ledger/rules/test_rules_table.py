"""Each rule as a pure function: a table of live states, the policy, the time -> the verdict."""

from __future__ import annotations

import pytest

from ledger.rules import rules as R
from ledger.rules.loop import LoopDetector
from ledger.rules.paraphrase import ParaphraseDetector
from ledger.rules.policy import RuleSettings

NOW = 10_000.0
P = RuleSettings(
    max_output_tokens=100,
    wall_clock_timeout_s=60,
    stall_timeout_s=10,
    max_preemptions=3,
    max_forced_waits=50,
    preemption_action="slow_pool",
    slow_pool_max_wait_s=30,
)


def looping() -> LoopDetector:
    d = LoopDetector(max_period=8, min_repeats=4, min_span_tokens=16)
    d.extend([7, 8, 9] * 10)
    return d


def paraphrasing() -> ParaphraseDetector:
    d = ParaphraseDetector(
        ngram=2, min_seen=1, window=8, min_recurrent_ratio=0.5, min_jumps=1, min_vocabulary=2
    )
    d.extend([1, 2, 3, 4, 5, 3, 4, 1, 2, 5, 3, 4, 1, 2])
    return d


def near_looping() -> LoopDetector:
    d = LoopDetector(max_period=8, min_repeats=4, min_span_tokens=16, min_period=4, changes=1)
    d.extend([t for i in range(10) for t in (100 + i, 8, 9, 10)])
    return d


CASES = [
    # (name, state fields, policy overrides, rule, expected (rule, action) or None)
    ("under the cap", {"output_tokens": 100}, {}, R.token_cap, None),
    ("over the cap", {"output_tokens": 101}, {}, R.token_cap, ("token_cap", "abort")),
    ("cap switched off", {"output_tokens": 10**6}, {"max_output_tokens": 0}, R.token_cap, None),
    (
        "no loop yet",
        {"detector": LoopDetector(max_period=8, min_repeats=4, min_span_tokens=16)},
        {},
        R.loop,
        None,
    ),
    ("loop found", {"detector": looping()}, {}, R.loop, ("loop", "abort")),
    ("loop rule disabled", {"detector": looping()}, {"loop": {"enabled": False}}, R.loop, None),
    ("no near-loop detector", {}, {}, R.near_loop, None),
    ("near-loop found", {"near_detector": near_looping()}, {}, R.near_loop, ("near_loop", "abort")),
    (
        "near-loop rule off",
        {"near_detector": near_looping()},
        {"near_loop": {"enabled": False}},
        R.near_loop,
        None,
    ),
    ("no paraphrase detector", {}, {"paraphrase_loop": {"enabled": True}}, R.paraphrase_loop, None),
    (
        "paraphrase loop found",
        {"paraphrase_detector": paraphrasing()},
        {"paraphrase_loop": {"enabled": True}},
        R.paraphrase_loop,
        ("paraphrase_loop", "abort"),
    ),
    ("paraphrase rule off", {"paraphrase_detector": paraphrasing()}, {}, R.paraphrase_loop, None),
    ("admitted 59 s ago", {"admitted_ts": NOW - 59}, {}, R.wall_clock_timeout, None),
    (
        "admitted 61 s ago",
        {"admitted_ts": NOW - 61},
        {},
        R.wall_clock_timeout,
        ("wall_clock_timeout", "abort"),
    ),
    ("never admitted", {}, {}, R.wall_clock_timeout, None),
    ("running, token 9 s ago", {"running": True, "last_progress_ts": NOW - 9}, {}, R.stall_timeout, None),
    (
        "running, token 11 s ago",
        {"running": True, "last_progress_ts": NOW - 11},
        {},
        R.stall_timeout,
        ("stall_timeout", "abort"),
    ),
    ("preempted, no token 11 s", {"running": False, "last_progress_ts": NOW - 11}, {}, R.stall_timeout, None),
    ("2 preemptions", {"preemptions": 2}, {}, R.preemption_limit, None),
    ("3 preemptions", {"preemptions": 3}, {}, R.preemption_limit, ("preemption_limit", "slow_pool")),
    (
        "3 preemptions, policy says non_preemptible",
        {"preemptions": 3},
        {"preemption_action": "non_preemptible"},
        R.preemption_limit,
        ("preemption_limit", "non_preemptible"),
    ),
    ("49 forced waits", {"forced_waits": 49}, {}, R.forced_wait_limit, None),
    ("50 forced waits", {"forced_waits": 50}, {}, R.forced_wait_limit, ("forced_wait_limit", "slow_pool")),
    ("not in the slow pool", {"last_progress_ts": NOW - 100}, {}, R.slow_pool_starved, None),
    (
        "slow pool, progress 5 s ago",
        {"slow_pool_ts": NOW - 100, "last_progress_ts": NOW - 5},
        {},
        R.slow_pool_starved,
        None,
    ),
    (
        "slow pool, starved 31 s",
        {"slow_pool_ts": NOW - 31, "last_progress_ts": NOW - 200},
        {},
        R.slow_pool_starved,
        ("slow_pool_starved", "promote"),
    ),
]


@pytest.mark.parametrize(
    ("name", "fields", "overrides", "rule", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_rule_table(name, fields, overrides, rule, expected):
    state = R.LiveRequest(request_id="r", **fields)
    nested = ("loop", "near_loop", "paraphrase_loop")
    policy = P.model_copy(update={k: v for k, v in overrides.items() if k not in nested})
    for key in nested:
        if key in overrides:
            policy = policy.model_copy(update={key: getattr(policy, key).model_copy(update=overrides[key])})
    if "max_output_tokens" in overrides and overrides["max_output_tokens"] == 0:
        policy = RuleSettings.model_validate({**P.model_dump(), "max_output_tokens": 0})
    v = rule(state, policy, NOW)
    assert (None if v is None else (v.rule, v.action)) == expected
    if v is not None:
        assert v.detail  # every verdict says why, with numbers


def test_evaluate_decides_each_rule_once_and_nothing_after_an_abort():
    r = R.LiveRequest(request_id="r", output_tokens=500, preemptions=5, forced_waits=500)
    first = R.evaluate(r, P, NOW)
    assert [(v.rule, v.action) for v in first] == [("token_cap", "abort")]
    for v in first:
        R.record(r, v, NOW)
    assert R.evaluate(r, P, NOW) == []


def test_evaluate_gives_one_slow_pool_for_two_limits_then_promotes_when_starved():
    r = R.LiveRequest(request_id="r", preemptions=5, forced_waits=500, last_progress_ts=NOW)
    got = R.evaluate(r, P, NOW)
    assert [(v.rule, v.action) for v in got] == [("preemption_limit", "slow_pool")]
    R.record(r, got[0], NOW)
    assert r.slow_pool_ts == NOW
    assert R.evaluate(r, P, NOW + 10) == []
    later = R.evaluate(r, P, NOW + 31)
    assert [(v.rule, v.action) for v in later] == [("slow_pool_starved", "promote")]


def test_finished_requests_get_no_verdict():
    r = R.LiveRequest(request_id="r", output_tokens=10**6, finished=True)
    assert R.evaluate(r, P, NOW) == []
