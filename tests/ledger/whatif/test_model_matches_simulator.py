"""The simulator and the what-if replay share one model of vLLM's scheduler
(``engine_hooks.scheduling``): a trace the simulator ran and recorded, replayed at the simulator's
settings with its departures from vLLM and its step cost, is scheduled the same, step by step.

The simulator's engine runs on virtual time here (its events carry it as ``ts``), so the replay sees
the same arrivals at the same step boundaries to the last bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from engine_hooks.config import ExporterConfig
from engine_hooks.events import Chunk, Finished, Preempted, Queued, Step
from engine_hooks.exporter import Exporter
from engine_hooks.scheduling.schedule import Scheduled
from engine_hooks.scheduling.settings import SIMULATOR
from engine_hooks.simulation.fleet import Fleet
from engine_hooks.simulation.scenario import SCENARIOS, Scenario
from ledger.whatif.model import replay
from ledger.whatif.state import State
from ledger.whatif.types import StepShape, TraceRequest
from tests.support.fake_ledger import FakeLedger, wait_until

FAST = {"spool_fsync": False, "flush_interval_s": 0.01}
StepSchedule = tuple[dict[str, int], list[str]]  # tokens per request, requests preempted for the step


class VirtualFleet(Fleet):
    """The fleet with its events stamped in virtual time."""

    def ts(self, t: float) -> float:
        return t


def simulate(scenario: Scenario, seed: int, rps: float, duration_s: float, tmp_path: Any) -> list[Any]:
    """One engine's events, in the order it emitted them, as the (fake) ledger stored them."""
    ledger = FakeLedger()
    try:

        def make_exporter(sid: str, kind: str, on_command: Any) -> Exporter:
            config = ExporterConfig.create(
                url=ledger.url, source_id=sid, source_kind=kind, spool_dir=str(tmp_path), **FAST
            )
            return Exporter(config, on_command=on_command)

        fleet = VirtualFleet(engines=1, rps=rps, scenario=scenario, seed=seed, make_exporter=make_exporter)
        fleet.run(duration_s, pace=False)
        emitted = fleet.engines[0].emitted
        for exporter in fleet.exporters.values():
            exporter.shutdown(10)
        engine = fleet.engines[0].id
        assert wait_until(lambda: sum(sid == engine for sid, _, _ in ledger.rows) == emitted, 10)
        rows = zip(ledger.rows, ledger.store.events, strict=True)
        mine = sorted(((seq, e) for (sid, seq, _), e in rows if sid == engine), key=lambda x: x[0])
        return [e for _, e in mine]
    finally:
        ledger.stop()


def simulated_steps(events: list[Any]) -> list[StepSchedule]:
    """Per step: the tokens each request computed (a chunk's, or a decode's 1), and who was preempted."""
    chunks: dict[int, dict[str, int]] = {}
    for e in events:
        if isinstance(e, Chunk):
            chunks.setdefault(e.step, {})[e.request_id] = e.tokens
    steps: list[StepSchedule] = []
    preempted: list[str] = []
    for e in events:
        if isinstance(e, Preempted):
            preempted.append(e.request_id)
        elif isinstance(e, Step):
            tokens = chunks.get(e.step, {})
            steps.append(({rid: tokens.get(rid, 1) for rid in e.request_ids}, preempted))
            preempted = []
    return steps


def recorded_trace(events: list[Any]) -> list[TraceRequest]:
    """The requests as the ledger knows them: queued time and prompt, first chunk's prefix hit, output
    (a request the run left unfinished: one token more than it had, so it outlives the run)."""
    queued = {e.request_id: e for e in events if isinstance(e, Queued)}
    cached: dict[str, int] = {}
    produced: dict[str, int] = {}
    for e in events:
        if isinstance(e, Chunk):
            cached.setdefault(e.request_id, e.cached_tokens)
        elif isinstance(e, Step):
            for rid, _, total, _ in e.token_groups():
                produced[rid] = total
    output = {e.request_id: e.output_tokens for e in events if isinstance(e, Finished)}
    return [
        TraceRequest(
            rid, q.ts, q.prompt_tokens, cached.get(rid, 0), output.get(rid, produced.get(rid, 0) + 1)
        )
        for rid, q in queued.items()
    ]


def replayed_steps(trace: list[TraceRequest], scenario: Scenario) -> list[StepSchedule]:
    steps: list[StepSchedule] = []

    def observe(st: State, scheduled: Scheduled) -> None:
        ids = st.request_id
        tokens = dict(zip((ids[i] for i in scheduled.idx.tolist()), scheduled.new.tolist(), strict=True))
        steps.append((tokens, [ids[i] for i, _ in scheduled.preempted]))

    sc = scenario

    def cost(s: StepShape) -> float:  # the simulator's step time
        return (
            sc.step_a_s
            + sc.step_b_s * s.prefill_tokens
            + sc.step_c_s * s.prefill_depth_tokens
            + (sc.step_d_s * s.num_decode_reqs)
        )

    replay(trace, scenario.engine_settings(), cost, departures=SIMULATOR, observe=observe)
    return steps


@pytest.mark.parametrize(
    ("name", "changes", "seed", "rps"),
    [
        ("chunk-threshold", {}, 4, 10),
        ("kv-pressure", {"long_prefill_token_threshold": 128}, 9, 30),
    ],
)
def test_the_replay_schedules_a_simulated_trace_as_the_simulator_did(name, changes, seed, rps, tmp_path):
    scenario = dataclasses.replace(SCENARIOS[name], step_tokens=True, runaway_p=0.0, **changes)
    events = simulate(scenario, seed, rps, 8.0, tmp_path)
    simulated = simulated_steps(events)
    replayed = replayed_steps(recorded_trace(events), scenario)
    assert len(simulated) > 500 and len(replayed) >= len(simulated)
    for k, (sim, rep) in enumerate(zip(simulated, replayed, strict=False)):
        assert sim == rep, f"step {k}"
    if name == "kv-pressure":
        assert sum(len(p) for _, p in simulated) > 100  # preemptions, victims and resumes compared too
        assert np.mean([len(t) for t, _ in simulated]) > 10
