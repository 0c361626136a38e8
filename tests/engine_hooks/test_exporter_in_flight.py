"""Several batches in flight: later batches go out while an earlier answer is slow, and nothing is lost,
duplicated or spooled out of order when some of them fail or shutdown gives up on them."""

from __future__ import annotations

import itertools
import time

import pytest

from engine_hooks.config import ConfigError, ExporterConfig
from engine_hooks.events import Command, Tokens
from tests.support.fake_ledger import FakeLedger, wait_until

TOKENS = ("ts", "request_id", "count", "total")
SEQ0 = 1000


def _rows(n: int, start: int = 0) -> list[tuple[float, str, int, int]]:
    return [(1.7e9, "r", 1, start + i + 1) for i in range(n)]


def _stored_seqs(ledger: FakeLedger, source: str = "engine-0") -> list[int]:
    return [seq for sid, seq, _ in ledger.rows if sid == source]


def _assert_stored_exactly_once(ledger: FakeLedger, n: int) -> None:
    assert _stored_seqs(ledger) == list(range(SEQ0, SEQ0 + n))  # every seq, once (the store keeps seq order)
    assert ledger.store.duplicates == 0  # and no event reached the ledger twice


def test_batches_emitted_after_a_slow_answer_are_acknowledged_before_it_returns(make_exporter, fake_ledger):
    exporter = make_exporter(batch_size=10, seq_start=SEQ0, timeout_s=10.0)
    tokens = exporter.emitter(Tokens, *TOKENS)
    fake_ledger.delays = [3.0]  # the first POST's answer (a slow commit) takes 3 s
    tokens.many(_rows(10))
    assert wait_until(lambda: len(fake_ledger.posts) == 1)
    started = time.monotonic()
    for i in range(3):  # a trickle: three partial batches, each sent on the flush timer
        tokens.many(_rows(5, start=10 + 5 * i))
        time.sleep(0.1)
    assert wait_until(lambda: exporter.stats().sent == 15, 2.5)
    assert time.monotonic() - started < 2.5
    first = fake_ledger.posts[0]
    assert first.answered is None  # still waiting on the first answer
    assert _stored_seqs(fake_ledger) == list(range(SEQ0 + 10, SEQ0 + 25))
    assert fake_ledger.max_in_flight >= 2

    assert exporter.force_flush(10)
    _assert_stored_exactly_once(fake_ledger, 25)
    assert first.answered is not None
    assert all(p.answered is not None and p.answered < first.answered for p in fake_ledger.posts[1:])
    stats = exporter.stats()
    assert (stats.sent, stats.batches_sent, stats.send_attempts, stats.duplicates) == (25, 4, 4, 0)
    assert (stats.send_failures, stats.spooled, stats.replayed, stats.dropped) == (0, 0, 0, {})


def test_max_in_flight_1_sends_the_next_batch_only_after_the_previous_answer(make_exporter, fake_ledger):
    exporter = make_exporter(batch_size=10, seq_start=SEQ0, max_in_flight=1, timeout_s=10.0)
    tokens = exporter.emitter(Tokens, *TOKENS)
    fake_ledger.delays = [1.0]
    tokens.many(_rows(10))
    assert wait_until(lambda: len(fake_ledger.posts) == 1)
    for i in range(3):
        tokens.many(_rows(5, start=10 + 5 * i))
        time.sleep(0.1)
    assert exporter.stats().sent == 0 and len(fake_ledger.posts) == 1  # the rest waits for the answer
    assert exporter.force_flush(10)
    _assert_stored_exactly_once(fake_ledger, 25)
    posts = fake_ledger.posts
    assert fake_ledger.max_in_flight == 1
    for before, after in itertools.pairwise(posts):
        assert before.answered is not None and after.arrived >= before.answered
        assert after.first_seq == before.last_seq + 1  # sent (and stored) in seq order
    assert exporter.stats().sent == 25


def test_a_batch_failing_among_several_in_flight_is_spooled_and_replayed_once_the_ledger_recovers(
    make_exporter, fake_ledger, spool_dir
):
    exporter = make_exporter(batch_size=10, seq_start=SEQ0, max_attempts=2)
    tokens = exporter.emitter(Tokens, *TOKENS)
    failing = {SEQ0 + 10}  # the second of four batches fails every attempt while the others succeed
    fake_ledger.delay_s = 0.2  # so that all four are in flight together
    fake_ledger.fail_if = lambda batch: 503 if batch.events[0].seq in failing else None
    tokens.many(_rows(40))
    assert wait_until(lambda: exporter.stats().spooled == 10, 5)
    assert wait_until(lambda: exporter.stats().sent == 30, 5)
    assert fake_ledger.max_in_flight >= 3
    stored = _stored_seqs(fake_ledger)
    assert stored == [*range(SEQ0, SEQ0 + 10), *range(SEQ0 + 20, SEQ0 + 40)]  # k failed, k+1, k+2 made it
    assert exporter.stats().spool_pending == 10
    assert not exporter.force_flush(0.3)  # k is replayed, and fails, until the ledger takes it

    failing.clear()
    tokens.many(_rows(10, start=40))  # fresh events queue behind the spooled batch
    assert exporter.force_flush(10)
    _assert_stored_exactly_once(fake_ledger, 50)
    stats = exporter.stats()
    assert stats.spooled == stats.replayed >= 10 and stats.sent == 50
    assert (stats.spool_pending, stats.spool_bytes, stats.duplicates, stats.dropped) == (0, 0, 0, {})
    assert not list((spool_dir / "engine-0").glob("*.seg"))
    replayed = [p for p in fake_ledger.posts if p.first_seq == SEQ0 + 10 and p.status == 200]
    assert len(replayed) == 1


def test_shutdown_with_batches_in_flight_on_a_stalled_ledger_meets_its_deadline_and_spools_them(
    make_exporter, fake_ledger
):
    exporter = make_exporter(batch_size=10, seq_start=SEQ0, timeout_s=10.0)
    fake_ledger.delay_s, fake_ledger.status = 3.0, 503  # stalled, and in the end not stored
    exporter.emitter(Tokens, *TOKENS).many(_rows(40))
    assert wait_until(lambda: fake_ledger.in_flight == 4)
    started = time.monotonic()
    assert exporter.shutdown(1.0)
    assert time.monotonic() - started < 1.3
    stats = exporter.stats()
    assert (stats.sent, stats.spooled, stats.spool_pending, stats.dropped) == (0, 40, 40, {})

    assert wait_until(lambda: fake_ledger.in_flight == 0, 5)  # the stalled POSTs end with 503s
    fake_ledger.delay_s, fake_ledger.status = 0.0, None
    successor = make_exporter(batch_size=10, seq_start=SEQ0 + 100)  # the same source and spool
    assert successor.force_flush(5)
    _assert_stored_exactly_once(fake_ledger, 40)
    stats = successor.stats()
    assert (stats.replayed, stats.spool_pending, stats.duplicates) == (40, 0, 0)


def test_batches_given_up_at_shutdown_but_stored_late_are_deduplicated_on_replay(make_exporter, fake_ledger):
    exporter = make_exporter(batch_size=10, seq_start=SEQ0, timeout_s=10.0)
    fake_ledger.delay_s = 1.5  # slow, but it stores them: only the answers come too late
    exporter.emitter(Tokens, *TOKENS).many(_rows(40))
    assert wait_until(lambda: fake_ledger.in_flight == 4)
    assert exporter.shutdown(0.5)
    assert exporter.stats().spooled == 40 and exporter.stats().sent == 0
    assert wait_until(lambda: fake_ledger.in_flight == 0, 5)
    assert _stored_seqs(fake_ledger) == list(range(SEQ0, SEQ0 + 40))  # late answers are ignored

    fake_ledger.delay_s = 0.0
    successor = make_exporter(batch_size=10, seq_start=SEQ0 + 100)
    assert successor.force_flush(5)
    assert _stored_seqs(fake_ledger) == list(range(SEQ0, SEQ0 + 40))
    stats = successor.stats()
    assert (stats.replayed, stats.duplicates, stats.spool_pending) == (40, 40, 0)


def test_a_command_in_several_concurrent_answers_reaches_the_callback_once(make_exporter, fake_ledger):
    received: list[Command] = []
    exporter = make_exporter(on_command=received.append, batch_size=10, command_poll_wait_s=0)
    fake_ledger.commands = [Command(id="c1", request_id="r", action="abort", rule="loop")]
    fake_ledger.delay_s = 0.2
    exporter.emitter(Tokens, *TOKENS).many(_rows(40))
    assert exporter.force_flush(5)
    assert fake_ledger.max_in_flight >= 2 and len(fake_ledger.posts) == 4
    assert [c.id for c in received] == ["c1"] and exporter.stats().commands == 1


def test_max_in_flight_comes_from_the_environment_defaults_to_4_and_must_be_positive():
    base = {"CHUNKLEDGER_URL": "http://127.0.0.1:8321", "CHUNKLEDGER_SOURCE_ID": "vllm-0"}
    assert ExporterConfig.from_env(base).max_in_flight == 4
    assert ExporterConfig.from_env({**base, "CHUNKLEDGER_MAX_IN_FLIGHT": "8"}).max_in_flight == 8
    with pytest.raises(ConfigError, match="CHUNKLEDGER_MAX_IN_FLIGHT"):
        ExporterConfig.from_env({**base, "CHUNKLEDGER_MAX_IN_FLIGHT": "0"})
