"""Ledger workers behind NATS JetStream, against the machine's NATS and PostgreSQL: exporters publish,
workers lease the partitions, store each batch once, terminate what can never be stored, take over a
killed worker's partitions, and send commands back to the sources whichever worker decided them."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from engine_hooks import events as ev
from engine_hooks import streams
from engine_hooks.config import ExporterConfig
from engine_hooks.exporter import Exporter
from engine_hooks.simulator import run_simulation
from ledger.jetstream.leases import holders
from tests.ledger.jetstream.conftest import _reachable
from tests.support.factories import body, numbered
from tests.support.servers import free_port

pytestmark = pytest.mark.timeout(300)


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until ``check()`` held; fails naming ``what`` past ``timeout``."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def one(pg_url: str, sql: str) -> Any:
    eng = sa.create_engine(pg_url)
    try:
        with eng.connect() as conn:
            return conn.execute(sa.text(sql)).scalar_one()
    finally:
        eng.dispose()


def count(pg_url: str, sql: str) -> int:
    return int(one(pg_url, sql))


def exporter(nats_url: str, stream: str, source_id: str, tmp_path: Path, **settings) -> Exporter:
    return Exporter(
        ExporterConfig(
            url="http://127.0.0.1:9",  # never used: batches and commands go through NATS
            source_id=source_id,
            model="m",
            nats_url=nats_url,
            nats_stream=stream,
            spool_dir=str(tmp_path / "spool"),
            spool_fsync=False,
            **settings,
        )
    )


async def _publish(url: str, subject: str, payloads: list[tuple[bytes, dict[str, str]]]) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        for data, headers in payloads:
            await js.publish(subject, data, headers=headers)
    finally:
        await nc.close()


def test_a_sources_batches_through_the_stream_are_stored_once(workers, nats_url, stream, pg_url, tmp_path):
    workers(partitions=4)
    wait_until(lambda: len(holders(pg_url, stream)) == 4, 10, "the worker holds every partition")
    exp = exporter(nats_url, stream, "engine.a", tmp_path)
    t0 = time.time()
    for i in range(3000):
        exp.emit(ev.Queued, ts=t0 + i * 1e-4, request_id=f"r{i}", prompt_tokens=3)
    assert exp.force_flush(20)
    stats = exp.stats()
    exp.shutdown()
    assert stats.sent == 3000 and stats.send_failures == 0 and stats.spooled == 0
    wait_until(lambda: count(pg_url, "SELECT count(*) FROM events") == 3000, 10, "3000 events stored")
    # The same events published again under other message ids (past JetStream's de-duplication, as a
    # replay from another exporter's spool would be): the store takes them once.
    src = ev.Source(id="engine.b", kind="engine", model="m")
    evs = numbered([ev.Queued(seq=0, ts=t0, request_id=f"b{i}", prompt_tokens=3) for i in range(50)])
    data = body(src, evs)
    subject = streams.events_subject(stream, src.id, 4)
    asyncio.run(_publish(nats_url, subject, [(data, {streams.MSG_ID: f"x{k}"}) for k in range(3)]))
    wait_until(lambda: count(pg_url, "SELECT count(*) FROM events") == 3050, 10, "engine.b's 50 events")
    time.sleep(1.0)  # the two copies after the first are consumed and change nothing
    assert count(pg_url, "SELECT count(*) FROM events") == 3050
    assert count(pg_url, "SELECT count(*) FROM requests") == 3050


def test_a_batch_that_can_never_be_stored_is_terminated_and_counted_not_redelivered(
    workers, nats_url, stream, pg_url
):
    server = workers(partitions=2)
    wait_until(lambda: len(holders(pg_url, stream)) == 2, 10, "the worker holds both partitions")
    src = ev.Source(id="engine.c", kind="engine", model="m")
    good = body(src, numbered([ev.Queued(seq=0, ts=time.time(), request_id="ok", prompt_tokens=3)]))
    subject = streams.events_subject(stream, src.id, 2)
    asyncio.run(_publish(nats_url, subject, [(b'{"schema_version": 1, "source"', {}), (good, {})]))
    wait_until(lambda: count(pg_url, "SELECT count(*) FROM events") == 1, 10, "the good batch stored")
    time.sleep(6.5)  # past the ack wait (5 s): a message not terminated would be delivered again
    text = httpx.get(f"{server.url}/metrics").text
    assert 'chunkledger_ingest_rejections_total{reason="invalid"} 1.0' in text


def _emitting(exporters: list[Exporter], stop: threading.Event, sent: list[int]) -> threading.Thread:
    def run() -> None:
        i = 0
        while not stop.is_set():
            t = time.time()
            for k, exp in enumerate(exporters):
                exp.emit(ev.Queued, ts=t, request_id=f"s{k}-{i}", prompt_tokens=3)
            i += 1
            sent[0] = i * len(exporters)
            time.sleep(0.002)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_killed_workers_partitions_are_taken_within_5s_and_nothing_is_lost_or_doubled(
    workers, nats_url, stream, pg_url, tmp_path
):
    partitions = 12
    started = [workers(partitions=partitions) for _ in range(3)]
    wait_until(
        lambda: (
            len(holders(pg_url, stream)) == partitions and len(set(holders(pg_url, stream).values())) == 3
        ),
        20,
        "three workers share the 12 partitions",
    )
    exporters = [exporter(nats_url, stream, f"engine.k{k}", tmp_path) for k in range(6)]
    stop, sent = threading.Event(), [0]
    thread = _emitting(exporters, stop, sent)
    time.sleep(2.0)
    victim = started[0]
    assert victim.proc is not None
    victim.stop(kill=True)  # SIGKILL: no goodbye, its connections die with it
    taken = wait_until(
        lambda: (
            len(holders(pg_url, stream)) == partitions and len(set(holders(pg_url, stream).values())) == 2
        ),
        5,
        "the survivors hold all 12 partitions",
    )
    time.sleep(2.0)
    stop.set()
    thread.join()
    for exp in exporters:
        assert exp.force_flush(30)
    stats = [exp.stats() for exp in exporters]
    for exp in exporters:
        exp.shutdown()
    emitted = sent[0]
    assert sum(s.sent for s in stats) == emitted and not any(s.dropped for s in stats)
    try:
        drained = wait_until(
            lambda: count(pg_url, "SELECT count(*) FROM events") >= emitted,
            10,
            f"all {emitted} events stored",
        )
    except AssertionError as exc:
        eng = sa.create_engine(pg_url)
        with eng.connect() as conn:
            stored = conn.execute(
                sa.text("SELECT source_id, count(*) FROM events GROUP BY 1 ORDER BY 1")
            ).all()
        eng.dispose()
        raise AssertionError(
            f"{exc}; stored per source {stored}, sent {[(x.source_id, x.sent) for x in stats]}"
        ) from None
    assert count(pg_url, "SELECT count(*) FROM events") == emitted  # none doubled
    assert count(pg_url, "SELECT count(*) FROM requests") == emitted
    assert taken <= 5 and drained <= 10


def _prefix_together(partitions: int) -> str:
    """A simulator source prefix whose engine and gateway share a partition (see the test's docstring)."""
    for prefix in (f"js{k}" for k in range(100)):
        engine, gateway = f"{prefix}-engine-0", f"{prefix}-gateway-0"
        if streams.partition_of(engine, partitions) == streams.partition_of(gateway, partitions):
            return prefix
    raise AssertionError("no prefix puts them together")


@pytest.mark.slow
def test_runaways_are_cut_through_the_stream_and_confirmed_by_engine_and_gateway(
    workers, nats_url, stream, pg_url, tmp_path
):
    """The fleet simulator's runaway scenario with every source on the stream and two workers sharing
    four partitions: the loop rule's commands go back on the commands subjects, the engine aborts and
    confirms, the gateway cuts the stream and confirms, and each command ends applied in the store.
    The engine and its gateway share a partition: the gateway's events are what tells the rules which
    gateway streams a request, and they reach the worker that decides only then (docs/design.md)."""
    first = workers(partitions=4)
    workers(partitions=4)
    wait_until(
        lambda: len(set(holders(pg_url, stream).values())) == 2 and len(holders(pg_url, stream)) == 4,
        15,
        "two workers share the four partitions",
    )
    prefix = _prefix_together(4)
    run_simulation(
        engines=1,
        rps=12,
        duration_s=6.0,
        ledger_url=first.url,
        scenario="runaway",
        seed=11,
        source_prefix=prefix,
        spool_dir=str(tmp_path / "spool"),
        overrides={
            "spool_fsync": False,
            "flush_interval_s": 0.02,
            "nats_url": nats_url,
            "nats_stream": stream,
        },
    )
    gateway_sid = one(pg_url, "SELECT source_id FROM sources WHERE kind = 'gateway'")
    engine_sid = f"{prefix}-engine-0"
    assert streams.partition_of(gateway_sid, 4) == streams.partition_of(engine_sid, 4)

    def settled() -> bool:
        cut = httpx.get(f"{first.url}/v1/cutoffs", params={"limit": 1000}).json()["cutoffs"]
        loops = [c for c in cut if c["rule"] == "loop"]
        return bool(loops) and all(c["state"] != "pending" for c in loops)

    wait_until(settled, 15, "every loop cutoff closed")
    cut = httpx.get(f"{first.url}/v1/cutoffs", params={"limit": 1000}).json()["cutoffs"]
    loops = [c for c in cut if c["rule"] == "loop"]
    finished = count(
        pg_url,
        "SELECT count(*) FROM requests WHERE max_tokens IS NULL AND finish_reason = 'cutoff' "
        "AND stop_reason = 'chunkledger:loop'",
    )
    assert finished == len(loops) > 0
    for c in loops:
        assert c["state"] == "applied", c
        assert c["applied_source_id"] == engine_sid and c["decided_ts"] <= c["applied_ts"]
        assert c["gateway_applied_ts"] is not None, c  # confirmed to the other worker


def _nats_server(port: int, store: Path) -> subprocess.Popen[bytes]:
    binary = shutil.which("nats-server") or "/usr/sbin/nats-server"
    return subprocess.Popen(
        [binary, "-js", "-p", str(port), "-sd", str(store), "-a", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_nats_down_the_exporter_spools_without_blocking_and_everything_arrives_once_it_is_back(
    pg_url, tmp_path
):
    """A NATS server of the test's own (so that it can be stopped): down for a while under load, the
    engine's emit never waits, the batches spool, and once it is back they reach the store once."""
    from tests.support.servers import LedgerServer

    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    nats = _nats_server(port, tmp_path / "js")
    worker = None
    try:
        wait_until(lambda: _reachable(url), 10, "nats-server listening")
        worker = LedgerServer(
            pg_url,
            tmp_path / "worker.log",
            env={
                "CHUNKLEDGER_NATS_URL": url,
                "CHUNKLEDGER_NATS_PARTITIONS": "2",
                "CHUNKLEDGER_NATS_BALANCE_S": "0.2",
            },
        )
        worker.start()
        exp = exporter(url, "CHUNKLEDGER", "engine.d", tmp_path, timeout_s=1.0, max_attempts=1)
        t0 = time.time()
        for i in range(500):
            exp.emit(ev.Queued, ts=t0, request_id=f"a{i}", prompt_tokens=3)
        assert exp.force_flush(10)
        nats.terminate()
        nats.wait(10)
        slowest = 0.0
        for i in range(2000):
            s = time.perf_counter()
            exp.emit(ev.Queued, ts=t0, request_id=f"b{i}", prompt_tokens=3)
            slowest = max(slowest, time.perf_counter() - s)
            if i % 100 == 0:
                time.sleep(0.05)
        wait_until(lambda: exp.stats().spooled > 0, 15, "batches spooled while NATS is down")
        # A publish waits up to 2 s for NATS (timeout_s + connect_timeout_s): an emit that waited on it
        # would take that long; the slowest one is a scheduling hiccup of this busy host at most.
        assert slowest < 0.1, f"an emit took {slowest * 1e3:.1f} ms"
        nats = _nats_server(port, tmp_path / "js")
        assert exp.force_flush(60)
        stats = exp.stats()
        exp.shutdown()
        assert stats.sent == 2500 and not stats.dropped
        wait_until(lambda: count(pg_url, "SELECT count(*) FROM events") == 2500, 20, "2500 events stored")
        assert count(pg_url, "SELECT count(*) FROM requests") == 2500
    finally:
        if worker is not None:
            worker.stop(kill=True)
        nats.kill()
        nats.wait(10)


async def _commands_seen(url: str, subject: str, seconds: float) -> list[str]:
    """The command ids published on ``subject`` over ``seconds`` (as a source's exporter takes them)."""
    import nats

    seen: list[str] = []
    nc = await nats.connect(url)
    try:

        async def on_message(msg) -> None:
            seen.extend(c.id for c in _decode_commands(msg.data))

        await nc.subscribe(subject, cb=on_message)
        await asyncio.sleep(seconds)
    finally:
        await nc.drain()
    return seen


def _decode_commands(data: bytes) -> list[ev.Command]:
    import msgspec

    return msgspec.json.decode(data, type=ev.CommandsResponse).commands


def test_a_pending_command_is_sent_again_by_the_next_owner_when_its_decider_is_killed(
    workers, nats_url, stream, pg_url
):
    """A loop decided on one worker, never confirmed by its engine: killed, that worker's partitions go
    to the other, which loads the pending command and sends it on until the engine confirms."""
    from tests.ledger.rules.test_commands import looping_tokens

    first = workers(partitions=2)
    wait_until(lambda: len(holders(pg_url, stream)) == 2, 10, "the first worker holds both partitions")
    src = ev.Source(id="engine.loop", kind="engine", model="m")
    t = time.time()
    evs = numbered(
        [ev.Queued(seq=0, ts=t, request_id="r-loop", prompt_tokens=3), *looping_tokens("r-loop", ts=t)]
    )
    subject = streams.events_subject(stream, src.id, 2)
    asyncio.run(_publish(nats_url, subject, [(body(src, evs), {})]))
    wait_until(
        lambda: count(pg_url, "SELECT count(*) FROM cutoffs WHERE state = 'pending'") == 1, 10, "a decision"
    )
    commands = streams.commands_subject(stream, src.id)
    before = asyncio.run(_commands_seen(nats_url, commands, 2.5))
    assert len(set(before)) == 1 and len(before) >= 2, before  # sent, and again until confirmed
    workers(partitions=2)
    first.stop(kill=True)
    wait_until(
        lambda: len(holders(pg_url, stream)) == 2 and len(set(holders(pg_url, stream).values())) == 1,
        5,
        "the second worker holds both partitions",
    )
    after = asyncio.run(_commands_seen(nats_url, commands, 2.5))
    assert set(after) == set(before) and len(after) >= 2, after
    # the engine confirms: the new owner stops sending and the command is applied
    confirm = numbered(
        [
            ev.CutoffApplied(
                seq=0, ts=time.time(), request_id="r-loop", command_id=before[0], action="abort", rule="loop"
            )
        ],
        len(evs) + 1,
    )
    asyncio.run(_publish(nats_url, subject, [(body(src, confirm), {})]))
    wait_until(
        lambda: count(pg_url, "SELECT count(*) FROM cutoffs WHERE state = 'applied'") == 1, 10, "applied"
    )
    assert asyncio.run(_commands_seen(nats_url, commands, 1.5)) == []
