"""Outages of the real ledger (``chunkledger serve`` in a subprocess) in the middle of a stream, and a
stalled commit of the real ledger app (in this process) while the rule engine waits for later batches.

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

from bench.toolkit import free_port
from engine_hooks.config import ExporterConfig
from engine_hooks.events import Command, Queued, Step, Tokens
from engine_hooks.exporter import Exporter
from tests.support.fake_ledger import wait_until

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


def test_an_exporter_on_columns_killed_ledger_and_spool_replay_store_every_step_once(ledger_server, tmp_path):
    """The columnar wire through a kill -9 mid-stream: steps carrying their tokens (as the plugin's
    ``step_tokens`` sends them) and queued events, spooled as columnar messages while the ledger is
    down and replayed after; every event stored once, the request rows' tokens exact."""
    exporter = _exporter(ledger_server, tmp_path / "spool", "engine-columns", wire="columns")
    assert exporter.stats().wire == "columns"
    queued = exporter.emitter(Queued, "ts", "request_id", "prompt_tokens")
    step = exporter.emitter(
        Step, "ts", "step", "duration_s", "running", "request_ids", "token_counts", "token_totals"
    )
    ids = [f"req-{i}" for i in range(64)]
    for rid in ids:
        queued(time.time(), rid, 100)
    for n in range(150):
        step(time.time(), n, 0.01, len(ids), ids, [1] * len(ids), [n + 1] * len(ids))
        if n == 50:
            ledger_server.stop(kill=True)
        if n == 90:
            ledger_server.start()
        time.sleep(0.01)
    assert exporter.force_flush(60)
    stats = exporter.stats()
    assert exporter.shutdown(10)
    assert stats.spooled > 0 and stats.replayed == stats.spooled and stats.dropped == {}
    assert stats.wire == "columns" and stats.numbered == len(ids) + 150
    _assert_exactly_once(_stored(ledger_server)["engine-columns"], exporter)
    path = ledger_server.db_url.removeprefix("duckdb:///")
    with duckdb.connect(path, read_only=True) as con:
        outputs = con.execute("SELECT DISTINCT output_tokens FROM requests").fetchall()
    assert outputs == [(150,)]


class _InThreadLedger:
    """The ledger app under uvicorn in this process, on a store whose next write can be stalled."""

    def __init__(self, db_url: str, stall_s: float):
        import uvicorn

        from ledger.app import create_app
        from ledger.config import Settings
        from ledger.store import open_store

        self.store = open_store(db_url)
        self.stall = threading.Event()  # set: the next write (group commit) sleeps stall_s first
        real_write = self.store.write

        def slow_write(batches, *rest):
            if self.stall.is_set():
                self.stall.clear()
                time.sleep(stall_s)
            return real_write(batches, *rest)

        self.store.write = slow_write  # type: ignore[method-assign]
        settings = Settings(db_url=db_url, ingest_token="ing", read_token="rd", admin_token="adm")
        app = create_app(settings, store=self.store)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.server.started, "ledger did not start"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.store.close()


@pytest.mark.parametrize("max_in_flight", [4, 1])
def test_a_cutoff_reaches_the_engine_while_an_earlier_batch_waits_on_a_stalled_commit(
    tmp_path, max_in_flight
):
    """The flaky demo: one slow commit must not hold back the batches the rule engine needs."""
    ledger = _InThreadLedger(f"duckdb:///{tmp_path / 'ledger.duckdb'}", stall_s=4.0)
    commands: list[tuple[float, Command]] = []
    exporter = Exporter(
        ExporterConfig.create(
            url=ledger.url,
            source_id="engine-stall",
            ingest_token="ing",
            spool_dir=str(tmp_path / "spool"),
            timeout_s=10.0,
            max_in_flight=max_in_flight,
            seq_start=1,
        ),
        on_command=lambda c: commands.append((time.monotonic(), c)),
    )
    try:
        exporter.emit(Queued, request_id="r1", prompt_tokens=9)
        assert exporter.force_flush(10)
        ledger.stall.set()
        exporter.emit(Queued, request_id="r2", prompt_tokens=3)  # its commit takes 4 s
        assert wait_until(lambda: not ledger.stall.is_set(), 5)
        started = time.monotonic()
        ids = [101, 2023, 318] * 70
        tokens = exporter.emitter(Tokens, "ts", "request_id", "count", "total", "token_ids")
        for i in range(len(ids) // 16):  # r1 loops, one step at a time
            tokens(time.time(), "r1", 16, (i + 1) * 16, ids[i * 16 : (i + 1) * 16])
            time.sleep(0.01)
        assert wait_until(lambda: bool(commands), 10)
        decided_after = commands[0][0] - started
        assert [(c.request_id, c.rule) for _, c in commands] == [("r1", "loop")]
        if max_in_flight > 1:
            assert decided_after < 2.5, f"cutoff after {decided_after:.1f} s"
        else:  # one at a time: r1's tokens waited for r2's answer, after the stalled commit
            assert decided_after > 3.5, f"cutoff after {decided_after:.1f} s"
        assert exporter.force_flush(15)
        stats = exporter.stats()
        assert (stats.sent, stats.duplicates, stats.spooled, stats.dropped) == (stats.numbered, 0, 0, {})
    finally:
        exporter.shutdown(5)
        ledger.close()
    path = str(tmp_path / "ledger.duckdb")
    with duckdb.connect(path, read_only=True) as con:
        seqs = [
            s for (s,) in con.execute("SELECT seq FROM events WHERE source_id = 'engine-stall'").fetchall()
        ]
    assert sorted(seqs) == list(range(1, stats.numbered + 1))


def test_ledger_down_60s_under_a_simulated_fleet_loses_nothing_stores_once_and_drains_while_it_runs(
    ledger_server, tmp_path
):
    """The issue's scene: 4 engines and a gateway at 40 requests/s, the ledger down for 60 s. Replay
    used to send one ~14-event POST at a time (300-900 events/s, slower than the fleet emits: the backlog
    never drained while the fleet ran). The backlog must drain while the fleet still emits, at several
    times the rate it grew; how fast (the goal: within 10 s) is measured by ``python -m bench.outage``,
    not here, where a loaded CI host sets the pace."""
    from engine_hooks import exporter as exporter_module
    from engine_hooks.simulator import run_simulation

    before_s, outage_s, after_s = 5.0, 60.0, 25.0
    result: dict = {}

    def simulate() -> None:
        result["summary"] = run_simulation(
            engines=4,
            rps=40,
            duration_s=before_s + outage_s + after_s,
            ledger_url=ledger_server.url,
            spool_dir=str(tmp_path / "spool"),
            overrides={"backoff_max_s": 1.0},
            drain_timeout_s=60,
        )

    sim = threading.Thread(target=simulate)
    sim.start()
    time.sleep(before_s)
    spool = str(tmp_path / "spool")
    # strong references (their stats after the run) to this run's exporters only: an earlier test's
    # exporter may still be alive in the WeakSet until the garbage collector gets to it
    exporters = [ex for ex in list(exporter_module._live) if (ex.config.spool_dir or "").startswith(spool)]
    assert len(exporters) == 5
    ledger_server.stop()
    time.sleep(outage_s)
    backlog = sum(ex.stats().spool_pending for ex in exporters)
    ledger_server.start()
    up = time.monotonic()
    drained_s = None
    while sim.is_alive() and time.monotonic() - up < 60:
        if sum(ex.stats().spool_pending for ex in exporters) == 0:
            drained_s = time.monotonic() - up
            break
        time.sleep(0.05)
    sim.join()
    summary = result["summary"]
    stored = _stored(ledger_server)
    print(f"backlog {backlog} events after {outage_s:.0f} s down; drained {drained_s} s after it was up")
    print(f"summary: {summary['exporter']} drain {summary['drain']}")
    assert backlog > 50_000, backlog  # the fleet kept emitting: a real backlog
    assert summary["exporter"]["dropped"] == {} and summary["drain"]["drained"]
    for ex in exporters:
        _assert_exactly_once(stored[ex.stats().source_id], ex)
    # drained while the fleet still emitted (after_s): replay outran the fleet by at least 60 / 25
    assert drained_s is not None, "the backlog did not drain while the fleet ran"
