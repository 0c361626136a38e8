"""The event-loop watchdog names what blocks the ledger's loop; group commits are measured."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi.testclient import TestClient

from engine_hooks import events as ev
from ledger.app import create_app
from ledger.config import Settings
from ledger.watchdog import LoopWatchdog


def _blocking_handler_of_the_test() -> None:
    time.sleep(0.8)


def test_a_blocked_loop_is_logged_with_the_blocking_stack_and_reported_when_it_ends(caplog):
    stalls: list[float] = []

    async def main() -> None:
        dog = LoopWatchdog(interval_s=0.05, threshold_s=0.3, on_stall=stalls.append)
        dog.start()
        await asyncio.sleep(0.2)
        _blocking_handler_of_the_test()
        await asyncio.sleep(0.3)
        await dog.stop()

    with caplog.at_level(logging.WARNING, logger="ledger.watchdog"):
        asyncio.run(main())
    assert len(stalls) == 1 and 0.6 < stalls[0] < 2.0
    text = caplog.text
    assert "has not turned" in text and "_blocking_handler_of_the_test" in text
    assert "was blocked for" in text


def test_a_loop_that_keeps_turning_reports_nothing():
    stalls: list[float] = []

    async def main() -> None:
        dog = LoopWatchdog(interval_s=0.05, threshold_s=0.3, on_stall=stalls.append)
        dog.start()
        for _ in range(10):
            await asyncio.sleep(0.05)
            time.sleep(0.05)  # short blocking calls stay under the threshold
        await dog.stop()

    asyncio.run(main())
    assert stalls == []


def test_group_commits_are_counted_in_the_metrics(tmp_path):
    settings = Settings(db_url=f"duckdb:///{tmp_path / 'l.duckdb'}")
    src = ev.Source(id="e0", kind="engine", model="m")
    with TestClient(create_app(settings), base_url="http://127.0.0.1") as c:
        for i in range(3):
            body = ev.encode_batch(
                src, [ev.Queued(seq=i + 1, ts=time.time(), request_id=f"r{i}", prompt_tokens=5)]
            )
            assert c.post("/v1/events", content=body).status_code == 200
        text = c.get("/metrics").text
    counts = [ln for ln in text.splitlines() if ln.startswith("chunkledger_ingest_group_seconds_count")]
    assert counts and float(counts[0].split()[-1]) == 3.0
    assert "chunkledger_event_loop_stalls_total 0.0" in text


def test_the_service_process_tunes_the_garbage_collector_only_when_asked(tmp_path):
    import gc

    from ledger.app import GC_THRESHOLDS

    before = gc.get_threshold()
    settings = Settings(db_url=f"duckdb:///{tmp_path / 'l.duckdb'}")
    try:
        with TestClient(create_app(settings)):
            assert gc.get_threshold() == before
        with TestClient(create_app(settings, tune_gc=True)):
            assert gc.get_threshold() == GC_THRESHOLDS
            assert gc.get_freeze_count() > 0
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
