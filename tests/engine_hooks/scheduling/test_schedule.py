"""The scheduling model's rules where its two callers could tell them apart: where the simulator's
model departs from vLLM's (each departure on its own), and a chunk that stops one token short of
its sequence's end. Blocks hold 16 tokens; each outcome is worked out in the test."""

from __future__ import annotations

import dataclasses

import numpy as np

from engine_hooks.scheduling.schedule import Scheduled, advance, choose_victim, schedule
from engine_hooks.scheduling.settings import SIMULATOR, VLLM, Departures, EngineSettings
from engine_hooks.scheduling.state import SchedulerState


def step(st: SchedulerState) -> Scheduled:
    """One schedule() and its step's progress."""
    s = schedule(st)
    advance(st, s.idx, s.new, s.before, 0.0)
    return s


def tokens(s: Scheduled) -> dict[int, int]:
    return dict(zip(s.idx.tolist(), s.new.tolist(), strict=True))


def preempt(st: SchedulerState, i: int) -> None:
    """Preempt running request ``i`` as the running pass would."""
    held = int(st.comp[i])
    st.run = st.run[st.run != i]
    st.preempt(i, held)


def test_a_step_that_preempted_admits_nobody_unless_the_model_departs_so() -> None:
    # 4 blocks, chunks capped at 16 tokens: a (16-token prompt) and b (33) take 2 blocks each by step 2;
    # in step 3, b's 33rd token needs a fifth block and b, the last running, preempts itself. vLLM admits
    # nobody in that step; the simulator's waiting pass runs and brings b back (at the queue's front)
    # with a first chunk of 16 tokens in one of the 2 blocks it freed.
    out = {}
    for name, departures in (("vllm", VLLM), ("admits", Departures(admit_after_preemption=True))):
        settings = EngineSettings(256, 8, 4, long_prefill_token_threshold=16, reserve_full_isl=False)
        st = SchedulerState(settings, departures)
        a, b = st.add(16, 0, 0.0), st.add(33, 0, 0.0)
        assert tokens(step(st)) == {a: 16, b: 16}
        assert tokens(step(st)) == {a: 1, b: 16} and st.used == 4
        s = step(st)
        out[name] = (tokens(s), s.preempted, s.admitted)
    assert out["vllm"] == ({0: 1}, [(1, 32)], 0)
    assert out["admits"] == ({0: 1, 1: 16}, [(1, 32)], 1)


def test_a_resumed_request_recomputes_from_its_prefix_hit_unless_the_model_recomputes_all() -> None:
    before = {}
    for name, departures in (("vllm", VLLM), ("all", Departures(recompute_all_on_resume=True))):
        st = SchedulerState(EngineSettings(256, 8, 100), departures)
        i = st.add(100, 32, 0.0)
        assert step(st).before.tolist() == [32]  # the first pass starts after its prefix hit
        preempt(st, i)
        s = step(st)
        before[name] = (s.before.tolist(), s.new.tolist())
    assert before == {"vllm": ([32], [69]), "all": ([0], [101])}  # prompt and its first token again


def test_the_simulators_victim_is_the_newest_arrival_not_the_last_running() -> None:
    # running 0..3 in that order, arrived at 0, 3, 2, 1 s; request 0 is being allocated
    for departures, victim in ((VLLM, 3), (Departures(victim_newest_arrival=True), 1)):
        st = SchedulerState(EngineSettings(64, 8, 100), departures)
        for arrival in (0.0, 3.0, 2.0, 1.0):
            st.add(16, 0, arrival)
        assert choose_victim(st, [0, 1, 2, 3], 0, "fcfs") == victim
    # nobody after the request being allocated: it yields itself
    assert choose_victim(st, [0, 1, 2, 3], 3, "fcfs") == 3


def test_the_simulator_departs_in_all_three_ways_and_vllm_in_none() -> None:
    assert dataclasses.astuple(VLLM) == (False, False, False)
    assert dataclasses.astuple(SIMULATOR) == (True, True, True)


def test_a_chunk_one_token_short_of_the_end_samples_no_token() -> None:
    # 20-token prompt, budget 19: the first chunk leaves one prompt token, and samples nothing
    st = SchedulerState(EngineSettings(19, 8, 100))
    st.add(20, 0, 0.0)
    s = schedule(st)
    assert advance(st, s.idx, s.new, s.before, 0.0).tolist() == [False]
    s = schedule(st)
    assert s.new.tolist() == [1] and advance(st, s.idx, s.new, s.before, 1.0).tolist() == [True]
    # budget 22: prompt, then two decodes (sequence 23, 22 computed); preempted, its recompute of 22
    # tokens ends one short of its 23: still no token; the 23rd position samples the 24th token
    st = SchedulerState(EngineSettings(22, 8, 100))
    i = st.add(20, 0, 0.0)
    for _ in range(3):
        step(st)
    assert (int(st.comp[i]), int(st.ntok[i])) == (22, 23)
    preempt(st, i)
    sampled = []
    for _ in range(2):
        s = schedule(st)
        sampled.append((s.new.tolist(), advance(st, s.idx, s.new, s.before, 0.0).tolist()))
    assert sampled == [([22], [False]), ([1], [True])]
    assert int(st.ntok[i]) == 24


def test_kv_idle_keeps_the_mark_of_each_requests_last_step() -> None:
    st = SchedulerState(EngineSettings(64, 8, 100, policy="kv-idle"))
    a, b = st.add(8, 0, 0.0), st.add(8, 0, 0.0)
    s = schedule(st)
    advance(st, s.idx[:1], s.new[:1], s.before[:1], 5.0)
    assert st.last_active[[a, b]].tolist() == [5.0, 0.0]


def test_the_running_pass_is_the_same_vectorized_or_not() -> None:
    prompts = np.random.default_rng(3).integers(1, 400, size=40).tolist()
    outcomes = []
    for vectorized in (True, False):
        st = SchedulerState(EngineSettings(512, 16, 120, long_prefill_token_threshold=96))
        for k, prompt in enumerate(prompts):
            st.add(prompt, 0, float(k))
        got = []
        for _ in range(60):
            s = schedule(st, vectorized)
            advance(st, s.idx, s.new, s.before, 0.0)
            got.append((s.idx.tolist(), s.new.tolist(), s.preempted))
        outcomes.append(got)
    assert outcomes[0] == outcomes[1]
    assert any(p for _, _, p in outcomes[0])  # the KV ran short: preemptions compared too
