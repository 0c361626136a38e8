"""Exporter behaviour against the in-thread fake ledger: delivery, order, retries, spool, drops, commands."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from engine_hooks.events import Command, Dropped, Finished, Queued, Step, Tokens
from tests.support.fake_ledger import FakeLedger, wait_until

TOKENS = ("ts", "request_id", "count", "total")


def _seqs(ledger: FakeLedger, source: str = "engine-0") -> list[int]:
    return [seq for sid, seq, _ in ledger.rows if sid == source]


def _markers(ledger: FakeLedger) -> list[Dropped]:
    return [e for e in ledger.store.events if isinstance(e, Dropped)]


def _data_events(ledger: FakeLedger) -> list[Tokens]:
    return [e for e in ledger.store.events if isinstance(e, Tokens)]


def test_events_are_stored_once_in_emit_order_with_contiguous_seqs(make_exporter, fake_ledger):
    exporter = make_exporter(batch_size=64)
    tokens = exporter.emitter(Tokens, *TOKENS)
    for i in range(1000):
        tokens(1.7e9 + i, f"r{i}", 1, i + 1)
    assert exporter.force_flush(5)
    seqs = _seqs(fake_ledger)
    assert len(seqs) == 1000
    assert seqs == list(range(seqs[0], seqs[0] + 1000))
    assert [e.total for e in _data_events(fake_ledger)] == list(range(1, 1001))
    assert exporter.stats().sent == 1000


def test_single_many_and_keyword_emits_keep_their_relative_order(make_exporter, fake_ledger):
    exporter = make_exporter()
    tokens = exporter.emitter(Tokens, *TOKENS)
    step = exporter.emitter(Step, "ts", "step", "duration_s", "request_ids")
    exporter.emit(Queued, ts=1.7e9, request_id="a", prompt_tokens=10)
    tokens.many([(1.7e9, "a", 1, 1), (1.7e9, "b", 1, 1)])
    step(1.7e9, 0, 0.01, ["a", "b"])
    tokens(1.7e9, "a", 1, 2)
    exporter.emit(Finished, request_id="a", reason="stop", output_tokens=2)
    assert exporter.force_flush(5)
    kinds = [kind for _, _, kind in fake_ledger.rows]
    assert kinds == ["queued", "tokens", "tokens", "step", "tokens", "finished"]
    seqs = _seqs(fake_ledger)
    assert seqs == sorted(seqs) and len(set(seqs)) == 6


def test_emitter_without_ts_stamps_the_wall_clock(make_exporter, fake_ledger):
    exporter = make_exporter()
    tokens = exporter.emitter(Tokens, "request_id", "count", "total")
    before = time.time()
    tokens("r", 1, 1)
    tokens.many([("r", 1, 2), ("r", 1, 3)])
    assert exporter.force_flush(5)
    stamps = [e.ts for e in _data_events(fake_ledger)]
    assert len(stamps) == 3 and all(before <= ts <= time.time() for ts in stamps)


def test_emitter_rejects_unknown_missing_or_reserved_fields_at_setup(make_exporter):
    exporter = make_exporter()
    with pytest.raises(ValueError, match="unknown"):
        exporter.emitter(Tokens, "ts", "request_id", "count", "total", "colour")
    with pytest.raises(ValueError, match="required"):
        exporter.emitter(Tokens, "ts", "request_id", "count")
    with pytest.raises(ValueError, match="reserved"):
        exporter.emitter(Tokens, "seq", "ts", "request_id", "count", "total")
    with pytest.raises(ValueError, match="not an event type"):
        exporter.emitter(int, "ts")


def test_bearer_token_is_sent_only_when_configured(make_exporter, fake_ledger, tmp_path):
    with_token = make_exporter(ingest_token="s3cret", source_id="with-token")
    with_token.emit(Queued, request_id="a", prompt_tokens=1)
    assert with_token.force_flush(5)
    without = make_exporter(source_id="no-token")
    without.emit(Queued, request_id="a", prompt_tokens=1)
    assert without.force_flush(5)
    assert fake_ledger.auth_headers == ["Bearer s3cret", None]


def test_server_error_is_retried_and_delivered_without_spooling(make_exporter, fake_ledger):
    exporter = make_exporter(max_attempts=3)
    fake_ledger.fail_next = [503]
    exporter.emit(Queued, request_id="a", prompt_tokens=1)
    assert exporter.force_flush(5)
    stats = exporter.stats()
    assert stats.retried == 1 and stats.send_failures == 1 and stats.spooled == 0
    assert len(_seqs(fake_ledger)) == 1


def test_ledger_down_spools_then_replays_in_order_when_it_is_back(make_exporter, fake_ledger, spool_dir):
    exporter = make_exporter(batch_size=50)
    tokens = exporter.emitter(Tokens, *TOKENS)
    for i in range(100):
        tokens(1.7e9, "r", 1, i + 1)
    assert exporter.force_flush(5)
    fake_ledger.stop()
    for i in range(100, 400):
        tokens(1.7e9, "r", 1, i + 1)
    assert not exporter.force_flush(0.5)
    assert exporter.stats().spooled == 300
    assert any(p.suffix == ".seg" for p in (spool_dir / "engine-0").iterdir())
    restarted = len(fake_ledger.posts)  # taken while it is down: a replay may come the moment it starts
    fake_ledger.start()
    for i in range(400, 500):
        tokens(1.7e9, "r", 1, i + 1)
    assert exporter.force_flush(5)
    assert [e.total for e in _data_events(fake_ledger)] == list(range(1, 501))
    seqs = _seqs(fake_ledger)
    assert seqs == list(range(seqs[0], seqs[0] + 500))
    # the backlog went out oldest first, one batch after the other
    replayed = [p.first_seq for p in fake_ledger.posts[restarted:] if p.status == 200]
    assert replayed == sorted(replayed) and replayed[0] == seqs[100]
    stats = exporter.stats()
    # events emitted while older ones still waited in the spool went behind them, through the spool
    assert stats.spooled >= 300 and stats.replayed == stats.spooled
    assert stats.spool_pending == 0 and stats.spool_bytes == 0


def test_a_backlog_is_replayed_in_merged_posts_with_several_in_flight(make_exporter, fake_ledger):
    exporter = make_exporter(batch_size=50, replay_max_events=500, max_in_flight=4)
    tokens = exporter.emitter(Tokens, *TOKENS)
    fake_ledger.stop()
    for i in range(3000):
        tokens(1.7e9, "r", 1, i + 1)
    assert not exporter.force_flush(0.5)
    assert exporter.stats().spool_pending == 3000  # 60 spooled batches of 50
    fake_ledger.delay_s = 0.05  # each POST takes a while: the window fills up
    restarted = len(fake_ledger.posts)  # taken while it is down: a replay may come the moment it starts
    fake_ledger.start()
    assert exporter.force_flush(10)
    replays = [p for p in fake_ledger.posts[restarted:] if p.status == 200]
    sizes = [p.last_seq - p.first_seq + 1 for p in replays]
    # 3000 events in 6 POSTs of 10 merged batches each (was: 60 POSTs, one at a time)
    assert sizes == [500] * 6, sizes
    assert fake_ledger.max_in_flight >= 2
    assert [e.total for e in _data_events(fake_ledger)] == list(range(1, 3001))
    stats = exporter.stats()
    assert stats.replayed == 3000 and stats.spool_pending == 0 and stats.duplicates == 0


def test_a_replay_broken_by_a_failed_post_counts_each_spooled_event_replayed_once(make_exporter, fake_ledger):
    exporter = make_exporter(batch_size=50, replay_max_events=500, max_in_flight=4)
    tokens = exporter.emitter(Tokens, *TOKENS)
    fake_ledger.stop()
    for i in range(3000):
        tokens(1.7e9, "r", 1, i + 1)
    assert not exporter.force_flush(0.5)
    fake_ledger.delay_s = 0.05  # several replays in flight when the second one fails
    failed: list[int] = []

    def fail_second_replay_once(batch) -> int | None:
        if not failed and batch.events and batch.events[0].total == 501:
            failed.append(1)
            return 503
        return None

    fake_ledger.fail_if = fail_second_replay_once
    fake_ledger.start()
    assert exporter.force_flush(15)
    stats = exporter.stats()
    assert stats.sent > 3000 and stats.duplicates > 0  # the POSTs after the failed one were sent again
    assert stats.spooled == 3000 and stats.replayed == 3000 and stats.spool_pending == 0
    assert sorted({e.total for e in _data_events(fake_ledger)}) == list(range(1, 3001))


def test_a_merged_replay_the_ledger_refuses_is_sent_again_batch_by_batch_and_only_the_bad_one_dropped(
    make_exporter, fake_ledger
):
    exporter = make_exporter(batch_size=10, replay_max_events=1000, max_in_flight=1)
    tokens = exporter.emitter(Tokens, *TOKENS)
    fake_ledger.stop()
    for i in range(100):
        tokens(1.7e9, "r", 1, i + 1)
    assert not exporter.force_flush(0.5)
    first = exporter.stats().last_seq - 99
    bad = range(first + 40, first + 50)  # the fifth spooled batch is one the ledger refuses
    fake_ledger.fail_if = lambda batch: 422 if any(e.seq in bad for e in batch.events) else None
    fake_ledger.start()
    assert wait_until(lambda: exporter.stats().spool_pending == 0, 10)
    assert exporter.force_flush(5)
    totals = [e.total for e in _data_events(fake_ledger)]
    assert totals == list(range(1, 41)) + list(range(51, 101))
    assert exporter.stats().dropped == {"rejected": 10}
    assert [m.count for m in _markers(fake_ledger)] == [10]


def test_ledger_error_status_spools_like_an_outage(make_exporter, fake_ledger):
    exporter = make_exporter()
    fake_ledger.status = 500
    exporter.emit(Queued, request_id="a", prompt_tokens=1)
    assert not exporter.force_flush(0.3)
    assert exporter.stats().spooled == 1
    fake_ledger.status = None
    assert exporter.force_flush(5)
    assert len(_seqs(fake_ledger)) == 1


def test_on_columns_a_ledger_that_answers_415_gets_the_batch_as_json_and_json_from_then_on(
    make_exporter, fake_ledger
):
    """The fake reads JSON only, as a ledger from before the columnar message: the refused message and
    a columnar one spooled while the ledger was down are both delivered, as JSON."""
    exporter = make_exporter(wire="columns")
    step = exporter.emitter(Step, "ts", "step", "duration_s", "request_ids", "token_counts", "token_totals")
    fake_ledger.status = 500
    exporter.emit(Queued, request_id="a", prompt_tokens=1)
    step(time.time(), 1, 0.01, ["a"], [1], [1])
    assert not exporter.force_flush(0.3)
    assert exporter.stats().spooled == 2 and exporter.stats().wire == "columns"
    fake_ledger.status = None
    assert exporter.force_flush(5)
    exporter.emit(Finished, request_id="a", reason="stop", output_tokens=1)
    assert exporter.force_flush(5)
    stats = exporter.stats()
    assert (stats.wire, stats.dropped, stats.sent) == ("json", {}, 3)
    assert len(_seqs(fake_ledger)) == 3
    assert fake_ledger.store.events[1].token_totals == [1]


@pytest.mark.parametrize("status", [401, 403, 404])
def test_auth_and_not_found_errors_keep_the_batch_instead_of_dropping_it(make_exporter, fake_ledger, status):
    exporter = make_exporter()
    fake_ledger.status = status
    exporter.emit(Queued, request_id="a", prompt_tokens=1)
    assert not exporter.force_flush(0.3)
    assert exporter.stats().dropped == {}
    fake_ledger.status = None
    assert exporter.force_flush(5)
    assert len(_seqs(fake_ledger)) == 1


def test_rejected_batch_is_dropped_counted_and_marked(make_exporter, fake_ledger):
    exporter = make_exporter()
    fake_ledger.fail_next = [400]
    tokens = exporter.emitter(Tokens, *TOKENS)
    tokens.many([(1.7e9, "r", 1, i + 1) for i in range(10)])
    assert exporter.force_flush(5)
    assert exporter.stats().dropped == {"rejected": 10}
    markers = _markers(fake_ledger)
    assert [(m.reason, m.count) for m in markers] == [("rejected", 10)]
    assert exporter.stats().spooled == 0


def test_invalid_event_is_dropped_marked_and_leaves_no_seq_hole(make_exporter, fake_ledger):
    exporter = make_exporter()
    tokens = exporter.emitter(Tokens, *TOKENS)
    tokens(1.7e9, "r", 1, 1)
    tokens(1.7e9, "r", -5, 1)  # violates count >= 0
    tokens(1.7e9, "r", 1)  # wrong number of values
    exporter.emit(Queued, request_id="r", prompt_tokens=1, colour="red")  # unknown field
    tokens(1.7e9, "r", 1, 2)
    assert exporter.force_flush(5)
    assert [e.total for e in _data_events(fake_ledger)] == [1, 2]
    assert exporter.stats().dropped == {"invalid": 3}
    assert sum(m.count for m in _markers(fake_ledger) if m.reason == "invalid") == 3
    seqs = _seqs(fake_ledger)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_queue_full_without_spool_counts_drops_and_delivers_the_marker(make_exporter, fake_ledger):
    exporter = make_exporter(spool_max_bytes=0, queue_size=100, batch_size=20)
    tokens = exporter.emitter(Tokens, *TOKENS)
    fake_ledger.stop()
    for i in range(500):
        tokens(1.7e9, "r", 1, i + 1)
    assert wait_until(lambda: exporter.stats().dropped.get("queue_full", 0) > 0)
    fake_ledger.start()
    assert exporter.force_flush(5)
    dropped = exporter.stats().dropped["queue_full"]
    delivered = len(_data_events(fake_ledger))
    assert delivered + dropped == 500
    markers = _markers(fake_ledger)
    assert {m.reason for m in markers} == {"queue_full"}
    assert sum(m.count for m in markers) == dropped
    assert all(m.first_ts is not None for m in markers)


def test_spool_full_and_queue_full_drops_are_counted_and_marked(make_exporter, fake_ledger):
    exporter = make_exporter(spool_max_bytes=4096, spool_segment_bytes=4096, queue_size=100, batch_size=20)
    tokens = exporter.emitter(Tokens, *TOKENS)
    fake_ledger.stop()
    emitted = 0
    while exporter.stats().dropped.get("spool_full", 0) == 0 and emitted < 20_000:
        for _ in range(10):
            emitted += 1
            tokens(1.7e9, "r", 1, emitted)
        time.sleep(0.005)
    stats = exporter.stats()
    assert stats.dropped.get("spool_full", 0) > 0
    assert 0 < stats.spool_bytes <= 4096
    fake_ledger.start()
    assert exporter.force_flush(10)
    dropped = exporter.stats().dropped
    delivered = [e.total for e in _data_events(fake_ledger)]
    assert len(delivered) + sum(dropped.values()) == emitted
    assert delivered == sorted(delivered)
    markers = _markers(fake_ledger)
    assert {m.reason: 0 for m in markers}.keys() == dropped.keys()
    for reason, count in dropped.items():
        assert sum(m.count for m in markers if m.reason == reason) == count


def test_torn_spool_record_is_skipped_counted_and_the_rest_replayed(make_exporter, fake_ledger, spool_dir):
    fake_ledger.stop()
    first = make_exporter(batch_size=100)
    tokens = first.emitter(Tokens, *TOKENS)
    for i in range(300):
        tokens(1.7e9, "r", 1, i + 1)
    assert first.shutdown(5)
    assert first.stats().spooled == 300
    segment = max((spool_dir / "engine-0").glob("*.seg"))
    os.truncate(segment, segment.stat().st_size - 7)  # cut the last record short

    fake_ledger.start()
    second = make_exporter(batch_size=100)
    assert second.force_flush(5)
    stats = second.stats()
    assert stats.spool_torn_records == 1
    delivered = [e.total for e in _data_events(fake_ledger)]
    assert delivered == list(range(1, len(delivered) + 1))  # a prefix, in order, nothing corrupt
    lost = 300 - len(delivered)
    assert lost > 0
    assert stats.dropped == {"spool_torn": lost}
    assert [(m.reason, m.count) for m in _markers(fake_ledger)] == [("spool_torn", lost)]


def test_restarted_source_replays_its_spool_and_numbers_above_its_previous_run(make_exporter, fake_ledger):
    fake_ledger.stop()
    first = make_exporter()
    first.emit(Queued, request_id="a", prompt_tokens=1)
    assert first.shutdown(5)
    fake_ledger.start()
    second = make_exporter()
    second.emit(Queued, request_id="b", prompt_tokens=1)
    assert second.force_flush(5)
    assert [(e.request_id) for e in fake_ledger.store.events] == ["a", "b"]
    seqs = _seqs(fake_ledger)
    assert seqs[1] > seqs[0]


def test_commands_reach_the_callback_once_each(make_exporter, fake_ledger):
    received: list[Command] = []
    exporter = make_exporter(on_command=received.append)
    fake_ledger.commands = [Command(id="c1", request_id="r", action="abort", rule="loop")]
    for i in range(3):
        exporter.emit(Queued, request_id=f"r{i}", prompt_tokens=1)
        assert exporter.force_flush(5)
    assert [c.id for c in received] == ["c1"]
    assert exporter.stats().commands == 1


def test_commands_arrive_by_long_poll_without_any_event_being_sent(make_exporter, fake_ledger):
    received: list[Command] = []
    exporter = make_exporter(on_command=received.append, source_id="engine-7")
    fake_ledger.poll_commands = [Command(id="c9", request_id="r", action="abort", rule="token_cap")]
    assert wait_until(lambda: [c.id for c in received] == ["c9"], 5.0)
    assert "source_id=engine-7" in fake_ledger.polls[0] and "wait_s=" in fake_ledger.polls[0]
    # the same command in an ingest answer is not handed over twice
    fake_ledger.commands = list(fake_ledger.poll_commands)
    exporter.emit(Queued, request_id="a", prompt_tokens=1)
    assert exporter.force_flush(5)
    assert [c.id for c in received] == ["c9"] and exporter.stats().commands == 1
    assert fake_ledger.rows  # no event was needed for the poll; this one was sent afterwards


def test_no_command_poll_without_a_callback_or_when_disabled(make_exporter, fake_ledger):
    make_exporter(source_id="no-callback")
    make_exporter(on_command=lambda c: None, source_id="disabled", command_poll_wait_s=0)
    time.sleep(1.0)
    assert fake_ledger.polls == []


def test_failing_command_callback_is_contained_and_retried_on_the_next_answer(make_exporter, fake_ledger):
    calls: list[str] = []

    def callback(command: Command) -> None:
        calls.append(command.id)
        if len(calls) == 1:
            raise RuntimeError("host bug")

    exporter = make_exporter(on_command=callback)
    fake_ledger.commands = [Command(id="c1", request_id="r", action="abort", rule="loop")]
    exporter.emit(Queued, request_id="a", prompt_tokens=1)
    assert exporter.force_flush(5)
    exporter.emit(Queued, request_id="b", prompt_tokens=1)
    assert exporter.force_flush(5)
    assert calls == ["c1", "c1"]
    assert len(_seqs(fake_ledger)) == 2


def test_shutdown_drains_everything_queued(make_exporter, fake_ledger):
    exporter = make_exporter(flush_interval_s=10.0)  # the timer never fires: only shutdown sends
    tokens = exporter.emitter(Tokens, *TOKENS)
    for i in range(300):
        tokens(1.7e9, "r", 1, i + 1)
    assert exporter.shutdown(5)
    assert len(_data_events(fake_ledger)) == 300


def test_events_a_producer_holds_back_are_released_by_force_flush_and_shutdown(make_exporter, fake_ledger):
    exporter = make_exporter(flush_interval_s=10.0)
    tokens = exporter.emitter(Tokens, *TOKENS)
    held: list[int] = []

    def release() -> None:
        while held:
            tokens(1.7e9, "r", 1, held.pop(0))

    def failing() -> None:
        raise RuntimeError("a producer's bug")

    exporter.hold_back(failing)  # logged, and the others are still released
    exporter.hold_back(release)
    held += [1, 2]
    assert exporter.force_flush(5)
    assert [e.total for e in _data_events(fake_ledger)] == [1, 2]
    held.append(3)
    assert exporter.shutdown(5)
    assert [e.total for e in _data_events(fake_ledger)] == [1, 2, 3]


def test_shutdown_twice_is_harmless_and_later_emits_are_counted_not_raised(make_exporter, fake_ledger):
    exporter = make_exporter()
    tokens = exporter.emitter(Tokens, *TOKENS)
    tokens(1.7e9, "r", 1, 1)
    assert exporter.shutdown(5) is True
    assert exporter.shutdown(5) is True
    tokens(1.7e9, "r", 1, 2)
    tokens.many([(1.7e9, "r", 1, 3)])
    exporter.emit(Queued, request_id="a", prompt_tokens=1)
    assert exporter.stats().dropped == {"shutdown": 3}
    assert exporter.force_flush(0.1) is False or exporter.stats().queued == 0
    assert len(_data_events(fake_ledger)) == 1


def test_shutdown_with_the_ledger_down_spools_instead_of_losing(make_exporter, fake_ledger):
    fake_ledger.stop()
    exporter = make_exporter()
    exporter.emit(Queued, request_id="a", prompt_tokens=1)
    started = time.monotonic()
    assert exporter.shutdown(5)
    assert time.monotonic() - started < 2
    assert exporter.stats().spooled == 1 and exporter.stats().dropped == {}


def test_exporter_errors_never_reach_the_caller(make_exporter, fake_ledger):
    exporter = make_exporter(on_command=lambda c: 1 / 0)
    fake_ledger.commands = [Command(id="c1", request_id="r", action="abort", rule="loop")]
    tokens = exporter.emitter(Tokens, *TOKENS)
    tokens.many(None)  # type: ignore[arg-type]
    tokens.many([None])  # type: ignore[list-item]
    tokens(object(), "r", 1, 1)
    exporter.emit(Tokens, request_id=None)
    exporter.emit(object)  # type: ignore[arg-type]
    tokens(1.7e9, "r", 1, 1)
    assert exporter.force_flush(5)
    assert [e.total for e in _data_events(fake_ledger)] == [1]


def test_force_flush_reports_false_while_the_ledger_is_down(make_exporter, fake_ledger):
    exporter = make_exporter()
    fake_ledger.stop()
    exporter.emit(Queued, request_id="a", prompt_tokens=1)
    started = time.monotonic()
    assert exporter.force_flush(0.3) is False
    assert 0.25 < time.monotonic() - started < 2


def test_batch_size_bounds_each_post(make_exporter, fake_ledger):
    exporter = make_exporter(batch_size=10)
    exporter.emitter(Tokens, *TOKENS).many([(1.7e9, "r", 1, i + 1) for i in range(95)])
    assert exporter.force_flush(5)
    assert fake_ledger.store.posts == 10


def test_self_metrics_are_exposed_in_a_prometheus_registry(make_exporter, fake_ledger):
    registry = CollectorRegistry()
    exporter = make_exporter(registry=registry)
    exporter.emitter(Tokens, *TOKENS).many([(1.7e9, "r", 1, i + 1) for i in range(7)])
    assert exporter.force_flush(5)
    labels = {"source": "engine-0"}
    assert registry.get_sample_value("chunkledger_exporter_events_sent_total", labels) == 7
    assert registry.get_sample_value("chunkledger_exporter_send_attempts_total", labels) >= 1
    assert registry.get_sample_value("chunkledger_exporter_queue_events", labels) == 0
    assert (
        registry.get_sample_value(
            "chunkledger_exporter_events_dropped_total", {**labels, "reason": "spool_full"}
        )
        == 0
    )
    assert registry.get_sample_value("chunkledger_exporter_last_success_timestamp_seconds", labels) > 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_is_a_new_source_and_does_not_resend_the_parents_events(make_exporter, fake_ledger):
    exporter = make_exporter(flush_interval_s=10.0)
    exporter.emit(Queued, request_id="parent-queued", prompt_tokens=1)
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        try:
            exporter.emit(Queued, request_id="child", prompt_tokens=1)
            code = 0 if exporter.shutdown(5) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert exporter.shutdown(5)
    by_source = {
        (sid, e.request_id) for (sid, _, _), e in zip(fake_ledger.rows, fake_ledger.store.events, strict=True)
    }
    assert by_source == {("engine-0", "parent-queued"), (f"engine-0-{pid}", "child")}


def test_spool_folder_of_a_live_source_cannot_be_opened_twice(make_exporter, spool_dir: Path):
    from engine_hooks.spool import SpoolError

    make_exporter()
    with pytest.raises(SpoolError, match="in use"):
        make_exporter()


def test_shutdown_against_a_slow_ledger_spools_the_rest_within_its_timeout(make_exporter, fake_ledger):
    exporter = make_exporter(batch_size=10, flush_interval_s=10.0)
    fake_ledger.delay_s = 0.3
    exporter.emitter(Tokens, *TOKENS).many([(1.7e9, "r", 1, i + 1) for i in range(100)])
    started = time.monotonic()
    assert exporter.shutdown(1.0)
    assert time.monotonic() - started < 1.5
    stats = exporter.stats()
    assert stats.sent + stats.spooled == 100 and stats.spooled > 0 and stats.dropped == {}
