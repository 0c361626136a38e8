"""The what-if scheduler model on hand-built traces, each outcome worked out in the test.

Unless a test says otherwise, a step costs ``1 ms + 10 us per prefill token + 0.5 ms per decode``
(:func:`cost`), the KV cache is large, blocks hold 16 tokens.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

from engine_hooks.scheduling.queues import ReserveQueue
from engine_hooks.scheduling.schedule import choose_victim
from engine_hooks.scheduling.settings import EngineSettings
from ledger.advice.terms import StepData
from ledger.whatif.model import replay
from ledger.whatif.noise import StepNoise
from ledger.whatif.results import Replay, weighted_quantile
from ledger.whatif.state import State
from ledger.whatif.types import StepShape, TraceRequest


def cost(s: StepShape) -> float:
    return 0.001 + 1e-5 * s.prefill_tokens + 0.0005 * s.num_decode_reqs


def R(rid: str, arrival: float, prompt: int, out: int, cached: int = 0, priority: int = 0) -> TraceRequest:
    return TraceRequest(rid, arrival, prompt, cached, out, priority)


def run(reqs: list[TraceRequest], settings: EngineSettings) -> tuple[Replay, list[StepShape]]:
    """The replay and the shape of every step, in order (recorded by the plain loop: fast-forward
    calls the cost once for a run of equal shapes), checked equal to the fast-forwarded replay."""
    shapes: list[StepShape] = []

    def recording(s: StepShape) -> float:
        shapes.append(s)
        return cost(s)

    out = replay(reqs, settings, recording, fast_forward=False)
    assert _fingerprint(replay(reqs, settings, cost)) == _fingerprint(out)
    return out, shapes


def by_id(out: Replay, field: str) -> dict[str, float]:
    return dict(zip(out.request_id, getattr(out, field).tolist(), strict=True))


def gaps(out: Replay) -> list[float]:
    """The ITL samples expanded to one per token, rounded, sorted."""
    return sorted(
        round(g, 9) for g, w in zip(out.itl_gap_s, out.itl_count, strict=True) for _ in range(int(w))
    )


# -- prefill, chunking, thresholds -------------------------------------------------------------------


def test_one_request_alone_ttft_is_its_prefill_steps_and_each_chunk_has_its_shape() -> None:
    settings = EngineSettings(max_num_batched_tokens=256, max_num_seqs=8, num_kv_blocks=1000)
    out, shapes = run([R("a", 0.0, 1000, out=3)], settings)
    # 1000 tokens under a 256 budget: chunks 256, 256, 256, 232 starting at depth 0, 256, 512, 768;
    # blocks after each: 16, 32, 48, ceil(1000 / 16) = 63 of 1000
    assert shapes[:4] == [
        StepShape(256, 0, 0, 1, 0, 0.016),
        StepShape(256, 256 * 256, 256, 1, 0, 0.032),
        StepShape(256, 256 * 512, 512, 1, 0, 0.048),
        StepShape(232, 232 * 768, 768, 1, 0, 0.063),
    ]
    # then two decodes (tokens 2 and 3), positions 1000 and 1001 still in block 63
    assert shapes[4:] == [StepShape(0, 0, 0, 0, 1, 0.063)] * 2
    # TTFT = 4 steps of 1 ms + 1000 prefill tokens x 10 us = 14 ms; e2e adds 2 x 1.5 ms
    assert out.ttft_s[0] == pytest.approx(0.014)
    assert out.e2e_s[0] == pytest.approx(0.017)
    assert gaps(out) == [0.0015, 0.0015]
    assert out.steps == 6
    assert out.simulated_s == pytest.approx(0.017)


def test_short_behind_unchunked_long_prefill_waits_for_the_whole_step() -> None:
    settings = EngineSettings(2048, 8, 1000, enable_chunked_prefill=False)
    out, shapes = run([R("long", 0.0, 1000, out=2), R("short", 0.001, 100, out=1)], settings)
    # step 1 (t=0): the long prompt alone, 1000 tokens: 1 + 10 = 11 ms; the short arrived during it
    # step 2 (t=11 ms): the long's decode and the short's 100 tokens: 1 + 1 + 0.5 = 2.5 ms
    assert [s.prefill_tokens for s in shapes] == [1000, 100]
    assert by_id(out, "ttft_s")["long"] == pytest.approx(0.011)
    assert by_id(out, "ttft_s")["short"] == pytest.approx(0.0135 - 0.001)


def test_chunked_long_prefill_keeps_the_budget_until_its_last_chunk() -> None:
    # vLLM schedules running requests first: a running prefill takes min(remaining, budget), so the
    # short gets in only with what the long's last chunk leaves (no threshold, no reserve)
    settings = EngineSettings(256, 8, 1000)
    out, shapes = run([R("long", 0.0, 1000, out=2), R("short", 0.001, 100, out=1)], settings)
    # steps 1-3: long 256 each (3.56 ms each); step 4: long's last 232 + 24 of the short (3.56 ms);
    # step 5: long's decode + the short's last 76 tokens: 1 + 0.76 + 0.5 = 2.26 ms
    assert [(s.prefill_tokens, s.num_prefill_reqs, s.num_decode_reqs) for s in shapes] == [
        (256, 1, 0),
        (256, 1, 0),
        (256, 1, 0),
        (256, 2, 0),
        (76, 1, 1),
    ]
    ttft = by_id(out, "ttft_s")
    assert ttft["long"] == pytest.approx(4 * 0.00356)  # grew from 11 ms unchunked
    assert ttft["short"] == pytest.approx(4 * 0.00356 + 0.00226 - 0.001)  # later than unchunked (12.5 ms)


def test_long_prefill_threshold_caps_the_chunk_and_lets_a_second_prefill_share_the_step() -> None:
    settings = EngineSettings(256, 8, 1000, long_prefill_token_threshold=128)
    out, shapes = run([R("long", 0.0, 1000, out=2), R("short", 0.001, 100, out=1)], settings)
    # step 1 (t=0): the long alone: vLLM ignores the threshold for a single request: 256 tokens
    # step 2 (t=3.56 ms): two requests: long capped at 128 (depth 256), short 100 (depth 0) share it:
    #   228 tokens, 3.28 ms; the short's first token at 6.84 ms
    # steps 3-5: the long alone again (the short finished): 256, 256, then its last 104 tokens
    assert shapes[:5] == [
        StepShape(256, 0, 0, 1, 0, 0.016),
        StepShape(228, 128 * 256, 256, 2, 0, 0.031),  # blocks 24 (384 tokens) + 7 (100)
        StepShape(256, 256 * 384, 384, 1, 0, 0.040),
        StepShape(256, 256 * 640, 640, 1, 0, 0.056),
        StepShape(104, 104 * 896, 896, 1, 0, 0.063),
    ]
    ttft = by_id(out, "ttft_s")
    assert ttft["short"] == pytest.approx(0.00356 + 0.00328 - 0.001)
    # long: 3.56 + 3.28 + 3.56 + 3.56 + (1 + 1.04) = 16 ms, up from 14.24 ms without the threshold
    assert ttft["long"] == pytest.approx(0.016)


def test_prompt_over_budget_without_chunked_prefill_is_refused_naming_the_request() -> None:
    # vLLM's waiting pass stops at a head whose prompt exceeds the budget without chunked prefill:
    # it could never run (and vLLM refuses max_model_len > max_num_batched_tokens then)
    settings = EngineSettings(512, 8, 1000, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"request 'big'.*600 tokens.*max_num_batched_tokens 512"):
        replay([R("ok", 0.0, 100, 1), R("big", 0.1, 600, 1)], settings, cost)
    # the cached prefix is not computed: 600 - 128 fits
    replay([R("big", 0.0, 600, 1, cached=128)], settings, cost)
    # a prompt that fits, but whose recomputation after a preemption (prompt + output - 1) would not
    with pytest.raises(ValueError, match=r"request 'long-out'.*after a preemption.*599 tokens"):
        replay([R("long-out", 0.0, 500, 100)], settings, cost)


def test_request_larger_than_the_kv_cache_is_refused_naming_it() -> None:
    settings = EngineSettings(512, 8, num_kv_blocks=10)  # 160 tokens
    with pytest.raises(ValueError, match=r"request 'huge'.*161 tokens.*11 KV blocks"):
        replay([R("huge", 0.0, 150, 12)], settings, cost)  # 150 + 12 - 1 = 161 tokens


def test_cached_tokens_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match=r"request 'a'.*cached_tokens 10.*block_size 16"):
        replay([R("a", 0.0, 100, 1, cached=10)], EngineSettings(512, 8, 100), cost)


def test_max_num_seqs_caps_the_running_set() -> None:
    settings = EngineSettings(2048, max_num_seqs=2, num_kv_blocks=1000)
    reqs = [R(x, 0.0, 16, out=3) for x in "abc"]
    out, shapes = run(reqs, settings)
    # step 1: a and b (2 slots), 32 tokens: 1.32 ms; steps 2-3: their decodes, 2 ms each, b and a
    # finish with token 3; step 4: c, 16 tokens: 1.16 ms
    assert [(s.num_prefill_reqs, s.num_decode_reqs) for s in shapes] == [
        (2, 0),
        (0, 2),
        (0, 2),
        (1, 0),
        (0, 1),
        (0, 1),
    ]
    assert max(s.num_prefill_reqs + s.num_decode_reqs for s in shapes) == 2
    assert by_id(out, "ttft_s")["c"] == pytest.approx(0.00132 + 2 * 0.002 + 0.00116)


# -- KV exhaustion and preemption ----------------------------------------------------------------


def test_kv_exhaustion_fcfs_preempts_the_last_running_request_which_recomputes_on_resume() -> None:
    settings = EngineSettings(2048, 8, num_kv_blocks=5)  # 80 tokens of KV
    out, shapes = run([R("a", 0.0, 32, out=20), R("b", 0.0, 32, out=20)], settings)
    # step 1: both prompts (2 blocks each, 1 free), 64 tokens: 1.64 ms; both first tokens
    # step 2: a's decode takes the last block (position 32); b's needs one too: FCFS preempts the last
    #   running request, b itself, which frees its 2 blocks; a decodes alone (1.5 ms)
    # then b waits: its whole sequence (32 + 1 tokens = 3 blocks) never fits the 2 free blocks while a
    #   runs (a takes its 4th block at position 48), so a decodes alone to its 20th token (step 20)
    # step 21: b resumes and recomputes prompt + its 1 output token, 33 tokens (1.33 ms): its token 2
    # steps 22-39: b's tokens 3..20
    assert shapes[1] == StepShape(0, 0, 0, 0, 1, 3 / 5)
    assert shapes[20] == StepShape(33, 0, 0, 1, 0, 3 / 5)
    assert len(shapes) == 39
    pre = by_id(out, "preemptions")
    assert pre == {"a": 0, "b": 1}
    a_end = 0.00164 + 19 * 0.0015
    e2e = by_id(out, "e2e_s")
    assert e2e["a"] == pytest.approx(a_end)
    assert e2e["b"] == pytest.approx(a_end + 0.00133 + 18 * 0.0015)
    assert by_id(out, "ttft_s") == pytest.approx({"a": 0.00164, "b": 0.00164})
    # b's gap across its preemption (token 1 at 1.64 ms to token 2 after the recomputation) is one
    # ITL sample; all the others are 1.5 ms decode steps: 19 of a's, 18 of b's
    resumed_gap = round(a_end + 0.00133 - 0.00164, 9)
    assert gaps(out) == [0.0015] * 37 + [resumed_gap]


def test_priority_preempts_the_lowest_priority_even_one_already_scheduled() -> None:
    # x (priority 5, lower) runs first; y (priority 0) joins at step 2; 4 blocks of KV
    reqs = [R("x", 0.0, 32, out=10, priority=5), R("y", 0.0005, 16, out=10, priority=0)]
    # step 1: x's prompt (2 blocks): 1.32 ms. step 2: x's decode (3rd block) + y's prompt (4th): 1.66 ms
    # step 3: x decodes (no new block), then y needs a block: none free
    fcfs, _ = run(reqs, EngineSettings(2048, 8, 4))
    # FCFS preempts the last running request, y itself
    assert by_id(fcfs, "preemptions") == {"x": 0, "y": 1}
    prio, shapes = run(reqs, EngineSettings(2048, 8, 4, policy="priority"))
    # priority preempts the largest (priority, arrival): x, although scheduled already this step (its
    # token goes back to the budget); y decodes alone in step 3
    assert by_id(prio, "preemptions") == {"x": 1, "y": 0}
    assert shapes[2] == StepShape(0, 0, 0, 0, 1, 2 / 4)
    # y's tokens 2..10 in steps 3-11 while x cannot come back (34 tokens need 3 blocks, 2 free);
    # x recomputes 32 + 2 tokens in step 12 (1.34 ms), then decodes its tokens 4..10
    y_end = 0.00132 + 0.00166 + 9 * 0.0015
    assert by_id(prio, "e2e_s") == pytest.approx({"x": y_end + 0.00134 + 7 * 0.0015, "y": y_end - 0.0005})


def _state(last_active: list[float], policy: str) -> State:
    st = State(
        [R(f"r{k}", 0.0, 16, 1) for k in range(len(last_active))], EngineSettings(64, 8, 100, policy=policy)
    )
    st.last_active[:] = last_active
    return st


def test_kv_idle_victim_is_the_longest_idle_request_not_yet_scheduled() -> None:
    # running r0..r3, r1 being allocated; r2 idle since t=1, r3 since t=2, r0 (scheduled) since t=0
    running = [0, 1, 2, 3]
    assert choose_victim(_state([0.0, 5.0, 1.0, 2.0], "kv-idle"), running, 1, "kv-idle") == 2
    assert choose_victim(_state([0.0, 5.0, 1.0, 2.0], "fcfs"), running, 1, "fcfs") == 3
    # ties go to the later request (the plugin walks from the end with a strict "<")
    assert choose_victim(_state([0.0, 5.0, 1.0, 1.0], "kv-idle"), running, 1, "kv-idle") == 3
    # nobody after the request being allocated: it yields itself
    assert choose_victim(_state([0.0, 5.0, 1.0, 1.0], "kv-idle"), running, 3, "kv-idle") == 3


def test_kv_idle_replays_like_fcfs_because_running_order_is_idle_order() -> None:
    # In the modelled scheduler a running request is scheduled whenever a later one is (the running
    # pass skips nobody while budget is left), so the idlest candidate is always the last one: the
    # plugin's choice differs only where its commands reorder the queue or vLLM skips requests
    # (async scheduling, encoder budget), which the model does not have.
    reqs = _random_trace(3, 200)
    a = replay(reqs, EngineSettings(512, 64, 300), cost)
    b = replay(reqs, EngineSettings(512, 64, 300, policy="kv-idle"), cost)
    assert a.preemptions.sum() > 0
    assert _fingerprint(a) == _fingerprint(b)


# -- prefix cache, outputs, admission reserve ------------------------------------------------------


def test_prefix_cache_hit_shortens_the_first_chunk() -> None:
    settings = EngineSettings(256, 8, 1000)
    out, shapes = run([R("a", 0.0, 1000, out=1, cached=512)], settings)
    # 512 cached: 488 to compute, chunks 256 (depth 512) and 232 (depth 768); the hit's 32 blocks are
    # counted as its own: 48, then 63 blocks
    assert shapes == [
        StepShape(256, 256 * 512, 512, 1, 0, 0.048),
        StepShape(232, 232 * 768, 768, 1, 0, 0.063),
    ]
    assert out.ttft_s[0] == pytest.approx(2 * 0.001 + 488 * 1e-5)


def test_single_output_token_finishes_at_first_token_and_itl_excludes_the_ttft_gap() -> None:
    out, _ = run([R("one", 0.0, 100, out=1), R("three", 0.0, 100, out=3)], EngineSettings(2048, 8, 1000))
    # step 1: both prompts (200 tokens): 3 ms; "one" is done with its first token
    # steps 2-3: "three" decodes alone: 1.5 ms each; its 2 gaps are the only ITL samples
    assert by_id(out, "e2e_s") == pytest.approx({"one": 0.003, "three": 0.006})
    assert by_id(out, "ttft_s") == pytest.approx({"one": 0.003, "three": 0.003})
    assert gaps(out) == [0.0015, 0.0015]
    alone = replay([R("one", 0.0, 100, out=1)], EngineSettings(2048, 8, 1000), cost)
    assert alone.itl_gap_s.size == 0 and alone.summary()["itl_p99_s"] is None


def test_admission_reserve_leaves_room_for_a_waiting_short_prompt() -> None:
    reqs = [R("long", 0.0, 2000, out=1), R("short", 0.001, 100, out=1)]
    plain, _ = run(reqs, EngineSettings(512, 8, 1000))
    reserved, shapes = run(reqs, EngineSettings(512, 8, 1000, admission_reserve=0.25))
    # step 1 (t=0): the long alone, 512 tokens (6.12 ms): a lone request is never capped
    # step 2 (t=6.12 ms): reserve = min(0.25 x 512 = 128, demand); demand = the short's 100 tokens
    #   (a free slot, fits the KV); cap = max(64, 512 - 100, 100) = 412: the long takes 412 and the
    #   short its 100 in the same step (512 tokens, 6.12 ms): first token at 12.24 ms
    assert shapes[1] == StepShape(512, 412 * 512, 512, 2, 0, (58 + 7) / 1000)
    assert by_id(reserved, "ttft_s")["short"] == pytest.approx(0.01224 - 0.001)
    # without it the long keeps 512 a step; the short gets the 48 its last chunk leaves (step 4), and
    # its last 52 tokens in step 5 (1.52 ms)
    assert by_id(plain, "ttft_s")["short"] == pytest.approx(4 * 0.00612 + 0.00152 - 0.001)
    # the long pays: after 512 + 412, steps of 512, 512, 52: 4 x 6.12 + 1.52 ms
    assert by_id(reserved, "ttft_s")["long"] == pytest.approx(4 * 0.00612 + 0.00152)
    assert by_id(plain, "ttft_s")["long"] == pytest.approx(4 * 0.00612)


def test_admission_reserve_admits_the_shortest_waiting_prompt_first() -> None:
    reqs = [R("long", 0.0, 2000, out=1), R("a", 0.001, 120, out=1), R("b", 0.002, 60, out=1)]
    out, shapes = run(reqs, EngineSettings(512, 8, 1000, admission_reserve=0.25))
    # step 1: the long alone (512 tokens, 6.12 ms); a and b arrive during it
    # step 2: the queue, shortest first: b (60), a (120); demand = 60 + min(120, 128 - 60) = 128 (the
    #   reserve), cap = max(64, 512 - 128, 120) = 384: long 384, b 60, a the 68 left (512, 6.12 ms)
    # step 3: cap = max(64, 512 - 52, 52) = 460: long 460, a its last 52 (512 tokens, 6.12 ms)
    assert [(s.prefill_tokens, s.num_prefill_reqs) for s in shapes[:3]] == [(512, 1), (512, 3), (512, 2)]
    ttft = by_id(out, "ttft_s")
    assert ttft["b"] == pytest.approx(2 * 0.00612 - 0.002)
    assert ttft["a"] == pytest.approx(3 * 0.00612 - 0.001)
    # without the reserve: nobody joins before the long's last chunk (step 4: 464 + 48 of a, FCFS
    # order), then a's last 72 and b's 60 (step 5): both first tokens at the end of step 5
    fcfs = by_id(replay(reqs, EngineSettings(512, 8, 1000), cost), "ttft_s")
    step5_end = 4 * 0.00612 + (0.001 + 132e-5)
    assert fcfs == pytest.approx({"long": 4 * 0.00612, "a": step5_end - 0.001, "b": step5_end - 0.002})


def test_reserve_queue_orders_aged_requests_by_arrival_then_shortest_prompt() -> None:
    prompt = [900, 50, 300, 40]
    arrival = [0.0, 1.0, 1.5, 2.9]
    q = ReserveQueue(prompt, arrival, aging_s=2.0)
    for i in range(4):
        q.add(i)
    q.prepare(2.0)  # request 0 has waited 2 s: aged, first; the others shortest first
    assert list(q) == [0, 3, 1, 2]
    assert not q.would_change(2.5) and q.would_change(3.0)
    q.prepare(3.0)  # request 1 has waited 2 s too: aged, after 0 by arrival
    assert list(q) == [0, 1, 3, 2]
    assert q.pop() == 0  # admitted ...
    q.add_preempted(0)  # ... and preempted: aged, by its arrival, so first again
    assert list(q) == [0, 1, 3, 2] and q.head() == 0 and len(q) == 4


# -- fast-forward and the vectorised running pass change nothing --------------------------------


def _random_trace(seed: int, n: int) -> list[TraceRequest]:
    """Poisson arrivals (50/s), prompts 1..1500, outputs 1..200, 40% with a cached prefix,
    priorities 0..2."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(0.02, n))
    prompt = rng.integers(1, 1500, n)
    out = rng.integers(1, 200, n)
    cached = (prompt * rng.random(n) * (rng.random(n) < 0.4)).astype(np.int64) // 16 * 16
    cached = np.minimum(cached, (prompt - 1) // 16 * 16)
    prio = rng.integers(0, 3, n)
    return [
        TraceRequest(f"r{k}", float(arrival[k]), int(prompt[k]), int(cached[k]), int(out[k]), int(prio[k]))
        for k in range(n)
    ]


def _fingerprint(out: Replay) -> tuple[Any, ...]:
    itl: collections.Counter[float] = collections.Counter()
    for g, w in zip(out.itl_gap_s.tolist(), out.itl_count.tolist(), strict=True):
        itl[g] += w
    return (
        out.ttft_s.tolist(),
        out.e2e_s.tolist(),
        out.preemptions.tolist(),
        out.steps,
        out.simulated_s,
        dict(itl),
    )


def kv_cost(s: StepShape) -> float:
    """Uses every field, kv_usage included, so that a wrong shape anywhere shows."""
    return (
        0.002
        + 2e-5 * s.prefill_tokens
        + 3e-4 * s.num_decode_reqs
        + 1e-9 * s.prefill_depth_tokens
        + 1e-3 * s.kv_usage
    )


@pytest.mark.parametrize(
    "settings",
    [
        EngineSettings(512, 64, 300),
        EngineSettings(512, 64, 300, policy="priority"),
        EngineSettings(1024, 32, 400, long_prefill_token_threshold=200, admission_reserve=0.3),
        EngineSettings(2048, 64, 300, enable_chunked_prefill=False, reserve_full_isl=False),
        EngineSettings(512, 64, 300, reserve_full_isl=False, admission_reserve=0.2, admission_aging_s=0.5),
    ],
    ids=["fcfs", "priority", "threshold+reserve", "unchunked", "no-full-isl+reserve"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_fast_forward_and_vectorized_pass_give_the_plain_loops_results(
    settings: EngineSettings, seed: int
) -> None:
    # 250 requests at 50/s on 300-400 blocks of KV: the KV runs out, requests are preempted and resume
    reqs = _random_trace(seed, 250)
    fast = replay(reqs, settings, kv_cost)
    plain = replay(reqs, settings, kv_cost, fast_forward=False)
    loop = replay(reqs, settings, kv_cost, fast_forward=False, vectorized=False)
    assert fast.preemptions.sum() > 0
    assert not np.isnan(fast.e2e_s).any()
    assert _fingerprint(fast) == _fingerprint(plain) == _fingerprint(loop)
    # with step noise too: the fast-forward draws step k's factor as the plain loop does
    noise = StepNoise([0.9, 1.0, 1.1, 2.5], seed=seed)
    noisy = replay(reqs, settings, kv_cost, noise=noise)
    assert _fingerprint(noisy) == _fingerprint(
        replay(reqs, settings, kv_cost, noise=noise, fast_forward=False)
    )
    assert _fingerprint(noisy) != _fingerprint(fast)
    # and with the engine loop's time between steps: the fast-forward adds step k's as the plain loop does
    looped = StepNoise(
        [0.9, 1.0, 1.1, 2.5], seed=seed, decode_gaps=[0.001, 0.0, 0.004, 0.002], prefill_gaps=[0.003, 0.0]
    )
    with_loop = replay(reqs, settings, kv_cost, noise=looped)
    assert _fingerprint(with_loop) == _fingerprint(
        replay(reqs, settings, kv_cost, noise=looped, fast_forward=False, vectorized=False)
    )
    assert _fingerprint(with_loop) != _fingerprint(noisy)


# -- step noise ------------------------------------------------------------------------------------


def test_step_noise_draws_a_deterministic_factor_per_step_from_its_class() -> None:
    noise = StepNoise([1.0, 2.0, 3.0], seed=7)
    draws = [noise.decode(k)[0] for k in range(3000)]
    assert draws == [noise.decode(k)[0] for k in range(3000)]  # a function of the step, not a stream
    assert collections.Counter(draws).keys() == {1.0, 2.0, 3.0}
    assert all(400 < c < 1600 for c in collections.Counter(draws).values())  # spread, not stuck
    assert [StepNoise([1.0, 2.0, 3.0], seed=8).decode(k)[0] for k in range(50)] != draws[:50]
    with pytest.raises(ValueError, match="finite ratios > 0"):
        StepNoise([1.0, 0.0])
    with pytest.raises(ValueError, match="decode_gaps pairs with ratios"):
        StepNoise([1.0, 2.0], decode_gaps=[0.001])
    with pytest.raises(ValueError, match="finite prefill_gaps >= 0"):
        StepNoise([1.0], prefill_gaps=[-0.001])


def test_engine_loop_time_comes_before_a_step_that_follows_another_but_not_after_idle() -> None:
    def flat(shape: StepShape) -> float:
        return 0.010

    reqs = [
        TraceRequest("first", 0.0, 32, 0, 10),  # decodes steps 1-9 back to back
        TraceRequest("during", 0.030, 32, 0, 2),  # arrives in step 2: its prefill follows a step
        TraceRequest("after-idle", 1.0, 32, 0, 2),  # the engine is idle when it comes
    ]
    noise = StepNoise([1.0], decode_gaps=[0.002], prefill_gaps=[0.005])
    out = replay(reqs, EngineSettings(512, 64, 2000), flat, noise=noise)
    ttft = dict(zip(out.request_id, out.ttft_s.tolist(), strict=True))
    assert ttft["first"] == pytest.approx(0.010)  # no loop time before the first step
    assert ttft["after-idle"] == pytest.approx(0.010)  # nor after idle
    # steps 1 and 2 decode (12 ms each, to 0.034); step 3 runs its prefill beside a decode: 10 + 5 ms
    assert ttft["during"] == pytest.approx(0.034 + 0.015 - 0.030)
    gaps = sorted({round(g, 9) for g in out.itl_gap_s.tolist()})
    assert gaps == [0.012, 0.015]  # every inter-token gap is a step plus the loop before it
    plain = replay(reqs, EngineSettings(512, 64, 2000), flat, noise=StepNoise([1.0]))
    assert sorted({round(g, 9) for g in plain.itl_gap_s.tolist()}) == [0.010]


def test_step_noise_puts_the_windows_tail_into_the_replayed_itl_p99() -> None:
    # 3 % of the decode-only steps take 3x their fitted time: a mean replay's ITL p99 misses them
    reqs = [TraceRequest(f"r{k}", 0.05 * k, 32, 0, 150) for k in range(60)]
    settings = EngineSettings(512, 64, 2000)
    plain = replay(reqs, settings, kv_cost)
    noise = StepNoise([1.0] * 97 + [3.0] * 3, seed=1)
    noisy = replay(reqs, settings, kv_cost, noise=noise)

    def p99(out: Replay) -> float:
        return weighted_quantile(out.itl_gap_s, out.itl_count, 0.99)

    def p50(out: Replay) -> float:
        return weighted_quantile(out.itl_gap_s, out.itl_count, 0.50)

    assert p99(noisy) > 2.0 * p99(plain)
    assert p50(noisy) == pytest.approx(p50(plain), rel=0.1)


def test_step_noise_leaves_the_steps_with_a_prefill_chunk_at_their_fitted_time() -> None:
    # one output token each: every step runs a chunk, none is decode-only
    reqs = [TraceRequest(f"r{k}", 0.05 * k, 700, 0, 1) for k in range(40)]
    settings = EngineSettings(512, 64, 2000)
    plain = replay(reqs, settings, kv_cost)
    noisy = replay(reqs, settings, kv_cost, noise=StepNoise([5.0]))
    assert plain.ttft_s.tolist() == noisy.ttft_s.tolist() and plain.steps == noisy.steps > 40


def test_the_loop_after_a_step_is_charged_per_first_token_it_emitted() -> None:
    def flat(shape: StepShape) -> float:
        return 0.010

    # three prompts prefilled in one step (3 first tokens), then decode-only steps
    reqs = [TraceRequest(f"r{k}", 0.0, 32, 0, 4) for k in range(3)]
    noise = StepNoise([1.0], decode_gaps=[0.002], per_first_token=0.001)
    settings = EngineSettings(512, 64, 2000)
    out = replay(reqs, settings, flat, noise=noise)
    assert out.ttft_s.tolist() == [pytest.approx(0.010)] * 3
    # the first decode waits the loop (2 ms) and 1 ms for each of the 3 first tokens; the next ones 2 ms
    assert sorted({round(g, 9) for g in out.itl_gap_s.tolist()}) == [0.012, 0.015]
    assert out.e2e_s.tolist() == [pytest.approx(0.010 + 0.015 + 0.012 + 0.012)] * 3
    plain = replay(reqs, settings, flat, noise=noise, fast_forward=False, vectorized=False)
    assert _fingerprint(plain) == _fingerprint(out)  # the fast-forward charges it as the plain loop does
    with pytest.raises(ValueError, match="per_first_token >= 0"):
        StepNoise([1.0], per_first_token=-1e-3)


def _steps(
    duration: np.ndarray, interval: np.ndarray, prefill: np.ndarray, depth: np.ndarray, decodes: np.ndarray
) -> StepData:
    """Synthetic ``steps`` columns: one prefill request per step with ``prefill`` tokens at ``depth``."""
    return StepData.from_columns(
        {
            "duration_s": duration,
            "interval_s": interval,
            "prefill_tokens": prefill,
            "prefill_depth_tokens": prefill * depth,
            "max_prefill_depth": depth,
            "num_prefill_reqs": (prefill > 0).astype(float),
            "num_decode_reqs": decodes,
            "kv_usage": np.full(len(duration), 0.3),
        }
    )


def test_first_token_cost_is_the_loop_times_slope_on_the_previous_steps_prefills() -> None:
    from ledger.whatif.noise import first_token_cost, loop_gaps, window_noise

    rng = np.random.default_rng(1)
    n = 800
    prev = np.where(rng.random(n) < 0.1, rng.integers(1, 40, n), 0).astype(float)
    prefill = np.where(rng.random(n) < 0.2, rng.integers(32, 512, n), 0).astype(float)
    depth = np.where(prefill > 0, rng.integers(0, 8, n) * 512, 0).astype(float)
    decodes = rng.integers(1, 20, n).astype(float)
    duration = 0.002 + 1e-5 * prefill + 1e-9 * prefill * depth + 1e-4 * decodes
    loop = 0.0001 + 0.00014 * prev + rng.exponential(0.00005, n)  # 0.14 ms per first token
    data = _steps(duration, duration + loop, prefill, depth, decodes)
    gaps = loop_gaps(data)
    assert first_token_cost(data, prev, gaps) == pytest.approx(0.00014, rel=0.05)
    assert first_token_cost(data, np.zeros(n), gaps) == 0.0  # nothing to tell it by
    # the drawn loop times no longer hold what the first tokens cost
    from ledger.advice.fit import fit_step_time

    noise = window_noise(fit_step_time(data), data, prev_prefills=prev)
    assert noise is not None and noise.per_first_token == pytest.approx(0.00014, rel=0.05)
    assert max(noise.decode_gaps + noise.prefill_gaps) < 0.001 < float(loop.max())


def test_window_noise_takes_the_decode_only_steps_ratios_against_the_fit() -> None:
    from ledger.advice.fit import fit_step_time
    from ledger.whatif.noise import window_noise

    rng = np.random.default_rng(0)
    n = 600
    prefill = np.where(rng.random(n) < 0.3, rng.integers(64, 2048, n), 0).astype(float)
    depth = np.where(prefill > 0, rng.integers(0, 8, n) * 512, 0).astype(float)
    decodes = rng.integers(1, 32, n).astype(float)
    base = 0.002 + 2e-5 * prefill + 1e-9 * prefill * depth + 3e-4 * decodes
    factor = np.where(prefill > 0, 1.0, np.where(rng.random(n) < 0.05, 3.0, 1.0))  # decode-only hiccups
    loop = np.where(prefill > 0, 0.003, 0.001)  # the engine loop before each step
    interval = base * factor + loop
    interval[:5] = np.nan  # unknown (the source's first steps): no loop time drawn from them
    data = _steps(base * factor, interval, prefill, depth, decodes)
    fit = fit_step_time(data)
    noise = window_noise(fit, data)
    assert noise is not None
    assert max(noise.ratios) == pytest.approx(3.0, rel=0.05)  # the decode-only hiccups
    assert len(noise.ratios) == int(np.count_nonzero(prefill == 0))  # the prefill steps are not drawn
    # each ratio paired with the loop time before the same step; chunk steps' loop time apart
    assert len(noise.decode_gaps) == len(noise.ratios)
    known = np.isfinite(interval)
    assert sorted(noise.decode_gaps) == pytest.approx(
        sorted(np.where(known, loop, 0.0)[prefill == 0].tolist()), abs=1e-12
    )
    assert sorted(noise.prefill_gaps) == pytest.approx(
        sorted(np.where(known, loop, 0.0)[prefill > 0].tolist()), abs=1e-12
    )
    assert window_noise(fit, data.select(np.arange(n) < 10)) is None  # too few steps


# -- inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"num_kv_blocks": -1}, "num_kv_blocks"),
        ({"block_size": 0}, "block_size"),
        ({"long_prefill_token_threshold": -5}, "long_prefill_token_threshold"),
        ({"admission_reserve": 1.0}, "admission_reserve"),
        ({"admission_reserve": -0.1}, "admission_reserve"),
        ({"admission_aging_s": -1.0}, "admission_aging_s"),
        ({"policy": "lifo"}, "policy"),
    ],
)
def test_settings_validation_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = {"max_num_batched_tokens": 512, "max_num_seqs": 8, "num_kv_blocks": 100}
    with pytest.raises(ValueError, match=rf"^{field}: "):
        EngineSettings(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"prompt_tokens": 0}, "prompt_tokens"),
        ({"cached_tokens": 100}, "cached_tokens"),
        ({"cached_tokens": -16}, "cached_tokens"),
        ({"output_tokens": 0}, "output_tokens"),
        ({"arrival_s": float("nan")}, "arrival_s"),
    ],
)
def test_trace_request_validation_names_the_request_and_field(kwargs: dict[str, Any], words: str) -> None:
    base: dict[str, Any] = {
        "request_id": "q1",
        "arrival_s": 0.0,
        "prompt_tokens": 100,
        "cached_tokens": 0,
        "output_tokens": 5,
    }
    with pytest.raises(ValueError, match=rf"request 'q1': {words}"):
        TraceRequest(**{**base, **kwargs})


def test_step_cost_must_be_a_finite_nonnegative_time() -> None:
    with pytest.raises(ValueError, match=r"step_cost returned -1\.0"):
        replay([R("a", 0.0, 10, 1)], EngineSettings(64, 8, 100), lambda s: -1.0)


# -- results ---------------------------------------------------------------------------------


def test_weighted_quantile_is_lower_nearest_rank() -> None:
    values = list(range(1, 101))
    assert weighted_quantile(values, [1] * 100, 0.99) == 99  # the 99th smallest of 100
    assert weighted_quantile(values, [1] * 100, 0.5) == 50
    assert weighted_quantile(values, [1] * 100, 1.0) == 100
    assert weighted_quantile(values, [1] * 100, 0.0) == 1
    # weight 98 on 1 s, 1 on 5 s, 1 on 9 s: the p98 is 1 s, the p99 5 s, the p100 9 s
    assert weighted_quantile([9.0, 1.0, 5.0], [1, 98, 1], 0.98) == 1.0
    assert weighted_quantile([9.0, 1.0, 5.0], [1, 98, 1], 0.99) == 5.0
    assert weighted_quantile([9.0, 1.0, 5.0], [1, 98, 1], 1.0) == 9.0
    assert weighted_quantile([], [], 0.5) is None
    assert weighted_quantile([3.0, 4.0], [0, 0], 0.5) is None


def test_summary_splits_long_and_short_prompts_and_keeps_the_callers_order() -> None:
    # given out of arrival order; results come back in the order given
    reqs = [R("late", 0.5, 100, 2), R("long", 0.0, 3000, 1), R("early", 0.0, 100, 1)]
    out = replay(reqs, EngineSettings(4096, 8, 1000), cost)
    assert out.request_id == ["late", "long", "early"]
    # step 1 (t=0): long + early, 3100 tokens: 32 ms; "late" arrives at 0.5 s to an idle engine:
    # its prompt 2 ms, its decode 1.5 ms
    assert out.ttft_s.tolist() == pytest.approx([0.002, 0.032, 0.032])
    assert out.e2e_s.tolist() == pytest.approx([0.0035, 0.032, 0.032])
    s = out.summary(long_prompt_tokens=1000)
    assert s["long_ttft_s"] == pytest.approx([0.032])
    assert s["long_ttft_max_s"] == pytest.approx(0.032)
    assert s["short_ttft_p99_s"] == pytest.approx(0.032)  # the larger of the two shorts
    assert s["ttft_p50_s"] == pytest.approx(0.032)
    assert s["itl_p99_s"] == pytest.approx(0.0015)
    assert s["e2e_p99_s"] == pytest.approx(0.032)
    assert s["preemptions"] == 0 and s["requests"] == 3 and s["steps"] == 3
    assert out.simulated_s == pytest.approx(0.5035)
    assert "long_ttft_s" not in out.summary()
