"""bench/hol_bound.py's chunking bound with the per-chunk depth term: the greedy chunking it reports is
the fastest within the step limit, and the p99's slack can only make it faster."""

from __future__ import annotations

import random

from bench.hol_bound import greedy_cost
from engine_hooks.vllm.predict import attention_work

COEF = (2.0e-3, 11.4e-6, 4.3e-9, 266e-9)  # a, b, c, e as fitted on a 2-core CPU


def _step(n: int, depth: int) -> float:
    a, b, c, e = COEF
    return a + b * n + c * attention_work(n, depth) + e * depth


def _largest(depth: int, left: int, s_max: float) -> int:
    lo, hi = 1, left  # the step grows with n: the largest n within the limit, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _step(mid, depth) <= s_max else (lo, mid - 1)
    return lo


def test_no_chunking_within_the_step_limit_is_faster_than_the_greedy_one():
    L, s_max = 8000, 0.02
    steps, greedy = greedy_cost(COEF, L, s_max)
    rng = random.Random(0)
    tried = 0
    for _ in range(300):
        # a random chunking within the limit: at each depth a chunk between half the largest and it
        depth, cost = 0, 0.0
        while depth < L:
            largest = _largest(depth, L - depth, s_max)
            n = rng.randint(max(1, largest // 2), largest)
            assert _step(n, depth) <= s_max
            cost += _step(n, depth)
            depth += n
        assert cost >= greedy - 1e-9
        tried += 1
    assert tried == 300 and steps > 10


def test_the_slack_spent_on_one_step_never_costs_more_and_a_too_small_limit_has_no_chunking():
    L, s_max = 8000, 0.02
    _, plain = greedy_cost(COEF, L, s_max)
    _, boosted = greedy_cost(COEF, L, s_max, boost_at=0, boost=0.2)
    assert boosted < plain
    a, _, _, e = COEF
    assert greedy_cost(COEF, L, a + e * (L // 2)) is None  # past half the prompt not one token fits
