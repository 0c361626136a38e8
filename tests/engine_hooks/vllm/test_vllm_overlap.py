"""Step timing under vLLM's async scheduling, on the synthetic engine (TEST_VLLM_ENGINE=synthetic).

With async scheduling the engine core's batch queue calls ``schedule()`` for step N+1 before
``update_from_output()`` of step N, so "from a step's ``schedule()`` to its ``update_from_output()``"
spans the step before it too: about twice the device time. The plugin's ``step`` events must carry
the device time per step anyway (``duration_s``), with ``ts + duration_s`` at the step's completion, so
that the ledger's ``interval_s`` (one completion to the next) is the engine's cadence. Only a controlled
clock can check that to the percent: the synthetic device runs each step for a known time on a virtual
clock (:mod:`tests.engine_hooks.vllm.synthetic`). The same checks hold in lock-step (overlap off), where
the old and new measures agree. On the cpu engine there is no controlled clock: skipped.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine_hooks.events import Step
from tests.engine_hooks.vllm import synthetic
from tests.engine_hooks.vllm.vllm_helpers import attach_exporter, events_of, prompt, rid
from tests.support.factories import output_token_ids
from tests.support.fake_ledger import FakeLedger

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        synthetic.backend() != "synthetic",
        reason="needs the synthetic engine's controlled clock (TEST_VLLM_ENGINE=synthetic)",
    ),
]

TOLERANCE = 0.01  # relative: the durations are exact on the virtual clock but for float rounding


@pytest.fixture
def ledger():
    fake = FakeLedger()
    yield fake
    fake.stop()


@dataclass
class Timed:
    """One step as the engine core drove it: the plugin's step number, the virtual clock at its
    ``schedule()`` call and at the end of its ``update_from_output()``, and how the device ran it."""

    step: int
    scheduled: float
    updated: float = float("nan")
    device: synthetic.DeviceStep | None = None


@dataclass
class Probe:
    """Wraps the scheduler's ``schedule()`` and ``update_from_output()`` (on the instance, around the
    plugin's own) to record, in call order, when the engine core called them."""

    engine: Any
    steps: dict[int, Timed] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)  # ("schedule" | "update", step)
    _pending: dict[int, Timed] = field(default_factory=dict)  # id(SchedulerOutput) -> its step

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        sch = self.engine.scheduler
        schedule, update = sch.schedule, sch.update_from_output
        clock = self.engine.clock

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            step, at = sch._cl_step, clock.now()  # the number the plugin gives this step
            output = schedule(*args, **kwargs)
            self._pending[id(output)] = self.steps[step] = Timed(step, at)
            self.calls.append(("schedule", step))
            return output

        def timed_update(scheduler_output: Any, model_runner_output: Any) -> Any:
            outputs = update(scheduler_output, model_runner_output)
            timed = self._pending.pop(id(scheduler_output))
            timed.updated = clock.now()
            timed.device = self.engine.executor.device_step(scheduler_output)
            self.calls.append(("update", timed.step))
            return outputs

        monkeypatch.setattr(sch, "schedule", timed_schedule)
        monkeypatch.setattr(sch, "update_from_output", timed_update)

    def overlapped(self) -> int:
        """Steps N whose ``update_from_output()`` came after ``schedule()`` of step N+1."""
        order = {call: i for i, call in enumerate(self.calls)}
        return sum(
            1
            for (kind, n), i in order.items()
            if kind == "update" and order.get(("schedule", n + 1), len(order)) < i
        )


def _run(engine: Any, attach: Any, ledger: FakeLedger, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """A mixed workload (a long prefill in chunks beside short prompts decoding) with the probe on:
    (the probe, the ``step`` events of the steps that ran something, by step number)."""
    exporter = attach(ledger.url)
    errors = engine.scheduler.hook_errors  # (a session engine: other tests' count too)
    probe = Probe(engine)
    probe.install(monkeypatch)
    engine.add(rid("long"), prompt(1000), max_tokens=4)
    for _ in range(4):
        engine.add(rid("short"), prompt(60), max_tokens=24)
    engine.run()
    assert exporter.force_flush(10.0)
    steps = {s.step: s for s in events_of(list(ledger.store.events), Step)}
    assert len(steps) >= 20 and engine.scheduler.hook_errors == errors
    return probe, steps


def _mode(engine: Any) -> str:
    return f"overlap {'on' if engine.overlap else 'off'}"


def test_step_duration_is_the_device_time_not_schedule_to_update(engine, attach, ledger, monkeypatch):
    probe, steps = _run(engine, attach, ledger, monkeypatch)
    rows = []  # (step, reported duration, device time, schedule() -> update_from_output())
    for n, event in sorted(steps.items()):
        timed = probe.steps[n]
        assert timed.device is not None, n
        rows.append((n, event.duration_s, timed.device.device_s, timed.updated - timed.scheduled))
    table = "\n".join(
        f"  step {n}: duration_s {d * 1e3:.3f} ms, device {dev * 1e3:.3f} ms, "
        f"schedule->update {old * 1e3:.3f} ms ({old / dev:.2f}x)"
        for n, d, dev, old in rows
    )
    ratio = statistics.median(d / dev for _, d, dev, _ in rows)
    old_ratio = statistics.median(old / dev for *_, dev, old in rows)
    message = f"{_mode(engine)}: median duration/device {ratio:.3f}, schedule->update/device {old_ratio:.2f}"
    assert ratio == pytest.approx(1.0, rel=TOLERANCE), f"{message}\n{table}"
    wrong = [(n, d, dev) for n, d, dev, _ in rows if d != pytest.approx(dev, rel=TOLERANCE)]
    assert not wrong, f"{message}; steps off the device time: {wrong}\n{table}"
    if engine.overlap:  # the old measure counts the step before too
        assert old_ratio > 1.5, f"{message}\n{table}"
    else:
        assert old_ratio == pytest.approx(1.0, rel=TOLERANCE), f"{message}\n{table}"


def test_the_engine_core_overlaps_steps_only_with_async_scheduling(engine, attach, ledger, monkeypatch):
    probe, _ = _run(engine, attach, ledger, monkeypatch)
    overlapped = probe.overlapped()
    updates = sum(kind == "update" for kind, _ in probe.calls)
    if engine.overlap:
        assert overlapped >= updates // 2, (overlapped, updates, probe.calls[:12])
        assert engine.engine_core.batch_queue_size == 2
    else:
        assert overlapped == 0, probe.calls[:12]
        assert engine.engine_core.batch_queue is None


def test_consecutive_completions_are_the_device_time_apart(engine, attach, ledger, monkeypatch):
    """``ts + duration_s`` is the step's completion: on the wall clock the virtual clock maps to,
    the end of its ``update_from_output()``; two steps in a row on a busy device complete the later
    one's device time apart (the ledger's ``interval_s``)."""
    probe, steps = _run(engine, attach, ledger, monkeypatch)
    clock = engine.clock
    ends = {n: s.ts + s.duration_s for n, s in steps.items()}
    for n, end in ends.items():
        assert end == pytest.approx(clock.to_wall(probe.steps[n].updated), abs=1e-6), (n, _mode(engine))
    busy = []  # (step, interval, device time) for steps that followed the one before on the device
    numbers = sorted(ends)
    for a, b in itertools.pairwise(numbers):
        dev_a, dev_b = probe.steps[a].device, probe.steps[b].device
        assert dev_a is not None and dev_b is not None
        if dev_b.started == dev_a.finished:
            busy.append((b, ends[b] - ends[a], dev_b.device_s))
    assert len(busy) >= len(numbers) // 2, (len(busy), len(numbers))
    wrong = [row for row in busy if row[1] != pytest.approx(row[2], rel=TOLERANCE)]
    assert not wrong, f"{_mode(engine)}: (step, completion interval, device time) {wrong}"


def test_with_the_device_busy_the_outputs_are_folded_on_the_folders_thread(
    engine, ledger, tiny_model, tmp_path
):
    """On a GPU the engine thread waits for the device with the GIL released: the steps' outputs are
    folded there, on the folder's thread, not on the engine thread (engine_hooks.vllm.folding). An
    engine of its own whose device takes 20 ms a step on the real clock."""
    own = synthetic.SyntheticEngine(
        tiny_model,
        overlap=engine.overlap,
        mrv2=synthetic.mrv2(),
        clocked=False,
        real_time=True,
        device_time=lambda output: 0.020,
    )
    try:
        sch = own.scheduler
        exporter = attach_exporter(sch, ledger.url, str(tmp_path / "spool"))
        ids = [rid(f"busy{i}") for i in range(8)]
        for r in ids:
            own.add(r, prompt(40), max_tokens=30)
        outs = own.run()
        assert exporter.force_flush(10.0)
        folder = sch._cl_folder
        share = folder.folded_off / folder.folded
        # about 35 steps; some are folded on the engine thread by design (the last, when it goes idle)
        assert folder.folded >= 20 and share >= 0.8, (_mode(engine), folder.folded, folder.folded_off)
        tokens = output_token_ids(list(ledger.store.events))
        assert all(tokens[r] == list(outs[r].outputs[0].token_ids) for r in ids)
        sch.use_exporter(None)
        exporter.shutdown(2.0)
    finally:
        own.close()
