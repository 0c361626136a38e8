"""Outages of the real ledger (``chunkledger serve`` in a subprocess) in the middle of a stream.

What the ledger stored is read from its DuckDB file after the server has stopped. With several batches
in flight (the default) the ledger may store a batch after a newer one, so the order of storage is
checked only with ``max_in_flight=1``; exactly-once is checked always.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import duckdb
import pytest

from engine_hooks.config import ExporterConfig
from engine_hooks.events import Step, Tokens
from engine_hooks.exporter import Exporter

pytestmark = pytest.mark.slow


def _stored(server) -> dict[str, list[int]]:
    """Seqs per source in the order the ledger stored them (a batch at a time, seq order inside)."""
    server.stop()
    path = server.db_url.removeprefix("duckdb:///")
    with duckdb.connect(path, read_only=True) as con:
        rows = con.execute("SELECT source_id, seq FROM events ORDER BY ingested_ts, seq").fetchall()
    out: dict[str, list[int]] = {}
    for source_id, seq in rows:
        out.setdefault(source_id, []).append(seq)
    return out


def _exporter(server, spool: Path, source_id: str, **settings) -> Exporter:
    config = ExporterConfig.create(
        url=server.url,
        source_id=source_id,
        spool_dir=str(spool),
        backoff_max_s=0.5,
        connect_timeout_s=0.5,
        timeout_s=5.0,
        **settings,
    )
    return Exporter(config)


def _assert_exactly_once(stored: list[int], exporter: Exporter, in_order: bool = False) -> None:
    stats = exporter.stats()
    assert stats.last_seq is not None
    expected = list(range(stats.last_seq - stats.numbered + 1, stats.last_seq + 1))
    assert len(stored) == len(set(stored)), "duplicates stored"
    assert sorted(stored) == expected, f"missing {len(set(expected) - set(stored))} events"
    if in_order:
        assert stored == expected, "stored out of order"


def test_ledger_down_5s_mid_stream_stores_every_event_once_and_emit_stays_fast(ledger_server, tmp_path):
    exporter = _exporter(ledger_server, tmp_path / "spool", "engine-outage")
    tokens = exporter.emitter(Tokens, "ts", "request_id", "count", "total")
    step = exporter.emitter(Step, "ts", "step", "duration_s", "running")
    request_ids = [f"req-{i}" for i in range(249)]
    steps, per_step = 400, 250  # 100k events over ~8 s
    outage: dict[str, float] = {}

    def take_the_ledger_down() -> None:
        time.sleep(2.0)
        outage["down"] = time.monotonic()
        ledger_server.stop()
        time.sleep(5.0)
        ledger_server.start()
        outage["up"] = time.monotonic()

    controller = threading.Thread(target=take_the_ledger_down)
    controller.start()
    timings = []
    clock = time.perf_counter_ns
    for n in range(steps):
        ts = time.time()
        started = clock()
        step(ts, n, 0.01, 249)
        timings.append(clock() - started)
        for total, rid in enumerate(request_ids):
            started = clock()
            tokens(ts, rid, 1, n * 1000 + total)
            timings.append(clock() - started)
        time.sleep(0.02)
    controller.join()
    assert exporter.force_flush(60)
    stats = exporter.stats()
    assert exporter.shutdown(10)

    assert stats.numbered == steps * per_step
    assert stats.spooled > 0 and stats.replayed == stats.spooled and stats.dropped == {}
    _assert_exactly_once(_stored(ledger_server)["engine-outage"], exporter)
    timings.sort()
    p99_us = timings[int(len(timings) * 0.99)] / 1000
    print(
        f"emit p50 {timings[len(timings) // 2]} ns, p99 {p99_us * 1000:.0f} ns, max {timings[-1]} ns; {stats}"
    )
    assert p99_us < 20, f"emit p99 {p99_us:.1f} us"


@pytest.mark.parametrize("max_in_flight", [1, 4])
def test_ledger_killed_and_restarted_mid_stream_loses_and_duplicates_nothing(
    ledger_server, tmp_path, max_in_flight
):
    exporter = _exporter(ledger_server, tmp_path / "spool", "engine-kill", max_in_flight=max_in_flight)
    tokens = exporter.emitter(Tokens, "ts", "request_id", "count", "total")
    for n in range(120):
        tokens.many([(time.time(), f"req-{i}", 1, n + 1) for i in range(250)])
        if n == 40:
            ledger_server.stop(kill=True)
        if n == 60:
            ledger_server.start()
        time.sleep(0.01)
    assert exporter.force_flush(60)
    assert exporter.shutdown(10)
    # one batch at a time (and the spool replayed oldest first) stores in seq order
    _assert_exactly_once(_stored(ledger_server)["engine-kill"], exporter, in_order=max_in_flight == 1)
    assert exporter.stats().numbered == 120 * 250
