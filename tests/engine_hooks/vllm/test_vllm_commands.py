"""Ledger commands applied inside a real vLLM engine: abort, non_preemptible, slow_pool, promote."""

from __future__ import annotations

import httpx
import pytest

from engine_hooks.events import Chunk, Command, CutoffApplied, Finished, Preempted
from tests.engine_hooks.vllm.vllm_helpers import events_of, prompt, rid
from tests.support.fake_ledger import FakeLedger, wait_until

pytestmark = pytest.mark.vllm


@pytest.fixture
def ledger():
    fake = FakeLedger()
    yield fake
    fake.stop()


def test_abort_command_ends_the_request_with_the_rules_stop_reason(engine, attach, ledger):
    exporter = attach(ledger.url)
    r = rid("runaway")
    engine.add(r, prompt(30), max_tokens=1500)
    for _ in range(4):
        engine.step()
    command = Command(id="cmd-" + r, request_id=r, action="abort", rule="loop", detail="period 3")
    ledger.commands = [command]  # sent in every ingest answer until the test ends
    assert wait_until(lambda: exporter.stats().commands >= 1, 10.0)
    engine.scheduler.submit_command(command)  # the same command twice: applied once
    out = engine.run()[r]

    assert out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].stop_reason == "chunkledger:loop"
    assert 0 < len(out.outputs[0].token_ids) < 1500
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    (applied,) = events_of(events, CutoffApplied, r)
    assert (applied.command_id, applied.action, applied.rule) == (command.id, "abort", "loop")
    (fin,) = events_of(events, Finished, r)
    assert fin.reason == "cutoff" and fin.stop_reason == "chunkledger:loop"
    assert fin.output_tokens == len(out.outputs[0].token_ids)
    assert applied.seq < fin.seq
    assert engine.scheduler.kv_cache_manager.usage == 0.0  # its KV blocks were freed


def test_abort_of_a_waiting_request_closes_its_wait(engine, attach, ledger):
    exporter = attach(ledger.url)
    long = rid("long")
    engine.add(long, prompt(1500), max_tokens=2)
    engine.step()
    waiting = rid("queued")
    engine.add(waiting, prompt(40), max_tokens=5)
    engine.scheduler.submit_command(
        Command(id="c-" + waiting, request_id=waiting, action="abort", rule="budget")
    )
    outs = engine.run()
    assert outs[waiting].outputs[0].finish_reason == "abort"
    assert outs[waiting].outputs[0].stop_reason == "chunkledger:budget"
    assert exporter.force_flush(10.0)
    (fin,) = events_of(list(ledger.store.events), Finished, waiting)
    assert fin.reason == "cutoff" and fin.output_tokens == 0 and fin.wait_s is not None


def test_command_for_a_request_not_yet_in_the_engine_is_applied_when_it_arrives(engine, attach, ledger):
    exporter = attach(ledger.url)
    r = rid("early")
    engine.scheduler.submit_command(Command(id="c-" + r, request_id=r, action="abort", rule="loop"))
    engine.add(rid("other"), prompt(20), max_tokens=3)
    engine.step()  # the command finds no request yet: parked
    engine.add(r, prompt(20), max_tokens=500)
    out = engine.run()[r]
    assert out.outputs[0].stop_reason == "chunkledger:loop"
    assert exporter.force_flush(10.0)
    assert len(events_of(list(ledger.store.events), CutoffApplied, r)) == 1


def test_abort_cutoff_reaches_the_real_ledgers_request_row(engine, attach, ledger_server):
    exporter = attach(ledger_server.url)
    r = rid("cut")
    engine.add(r, prompt(30), max_tokens=1000)
    for _ in range(3):
        engine.step()
    # The rule engine would send this in an ingest answer; hand it over the way the exporter does.
    engine.scheduler.submit_command(Command(id="cmd-" + r, request_id=r, action="abort", rule="loop"))
    out = engine.run()[r]
    assert out.outputs[0].finish_reason == "abort"
    assert exporter.force_flush(10.0)
    row = httpx.get(f"{ledger_server.url}/v1/requests/{r}", timeout=5).json()["request"]
    assert row["cut_rule"] == "loop"
    assert row["stop_reason"] == "chunkledger:loop"
    assert row["output_tokens"] == len(out.outputs[0].token_ids)


def test_non_preemptible_request_is_never_the_victim(engine, attach, ledger):
    exporter = attach(ledger.url)
    ids = [rid(f"np{i}") for i in range(8)]
    for r in ids:
        engine.add(r, prompt(350), max_tokens=150)
    protected = ids[-1]  # vLLM's FCFS victim is the last running request: this one
    engine.scheduler.submit_command(
        Command(id="c-" + protected, request_id=protected, action="non_preemptible", rule="sla")
    )
    engine.run()
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    assert len(events_of(events, CutoffApplied, protected)) == 1
    preempted = events_of(events, Preempted)
    assert preempted, "the workload must preempt someone"
    assert protected not in {p.request_id for p in preempted}


def test_slow_pool_request_yields_but_keeps_progressing(engine, attach, ledger):
    exporter = attach(ledger.url)
    slow, other = rid("slow"), rid("other")
    engine.add(slow, prompt(1800), max_tokens=2)
    engine.step()  # slow runs first and would take the whole budget every step
    engine.add(other, prompt(1200), max_tokens=2)
    engine.scheduler.submit_command(
        Command(id="c-" + slow, request_id=slow, action="slow_pool", rule="tenant")
    )
    engine.run()
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    other_steps = {c.step for c in events_of(events, Chunk, other)}
    slow_steps = sorted(c.step for c in events_of(events, Chunk, slow))
    window = range(min(other_steps), max(other_steps) + 1)
    assert len(other_steps) >= 0.7 * len(window)  # the other request runs in most steps
    during = [s for s in slow_steps if s in window]
    every = engine.scheduler.options.slow_pool_every
    assert during, "slow_pool must still make progress"
    assert all(
        b - a <= every + 1 for a, b in zip([window.start, *during], [*during, window.stop], strict=True)
    )


def test_promote_admits_a_waiting_request_ahead_of_a_long_prefill(engine, attach, ledger):
    exporter = attach(ledger.url)
    long, vip = rid("long"), rid("vip")
    engine.add(long, prompt(1800), max_tokens=2)
    engine.step()
    engine.add(vip, prompt(60), max_tokens=2)
    engine.step()  # without the command the long prefill takes the whole budget: vip waits
    engine.scheduler.submit_command(Command(id="c-" + vip, request_id=vip, action="promote", rule="priority"))
    engine.run()
    assert exporter.force_flush(10.0)
    events = list(ledger.store.events)
    long_chunks = events_of(events, Chunk, long)
    vip_first = events_of(events, Chunk, vip)[0]
    assert vip_first.step < long_chunks[-1].step - 5  # admitted long before the long prefill ended
    assert vip_first.step <= long_chunks[1].step + 2
