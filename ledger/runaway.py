"""The runaway service: wires the rule engine to storage, delivery, webhooks and metrics.

It composes ``ledger.rules`` with ``ledger.webhooks`` and ``ledger.metrics`` from beside them (the
metrics name the rules' series, so the rules package does not know the metrics).

* ``observe_arrival(batch)`` runs the rule engine over a batch as soon as it is decoded, on this
  service's intake thread, beside the store's write: a cutoff does not wait for the database (a commit
  that stalls for seconds under load must not let a runaway stream on). The ingest handler waits for
  both before answering, so commands decided from a batch ride on that batch's answer.
* ``on_commit(batch, result)`` is the ingest writer's hook (writer thread, after a group commit): it
  counts what was stored.
* Decisions are stored (``cutoffs``), queued for delivery (``CommandBook``), counted and sent to the
  ``cutoff`` webhook subscribers. What the intake reports that writes to the database (decisions,
  confirmations, finished requests' moot commands, gateways joining, data-loss alerts) is stored on a
  recorder thread of its own, in order: the intake goes on with the next batches while a commit waits
  behind the ingest writer's (on DuckDB one commit at a time). Only the batch that made decisions
  waits for them to be stored, so their commands still ride on its answer.
* A ticker thread runs the time rules, expires stale commands, observes finished requests' latencies
  (one query per tick for all of them), watches the SLO and picks up policy versions from other replicas.

Which events are new: on arrival, those above this replica's high-water mark for the source (a retry
is skipped whole). Events at or below the mark that the store then accepts as new (a spooled batch
replayed after newer ones) are observed after the commit when the batch had no duplicates at all; in
the rare mixed case they are not (the store reports counts per batch, not which events).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from engine_hooks import events as ev
from ledger.alerts import Alert, CutoffAlert, DataLossAlert, StarvationAlert
from ledger.columnar import Columns
from ledger.rules import rules as R
from ledger.rules.commands import CommandBook, Pending
from ledger.rules.engine import Decision, RuleEngine
from ledger.rules.policy_store import PolicyStore
from ledger.rules.slo import SloMonitor, itl_of
from ledger.webhooks.outbox import Webhooks

if TYPE_CHECKING:  # the app hands the service its metrics and its trace export
    from ledger.metrics import LedgerMetrics
    from ledger.traces.export import TraceExport

log = logging.getLogger(__name__)

OBSERVE_DELAY_S = 3.0  # wait this long after the engine's finish before reading the row (gateway end)
_VIEW_COLUMNS = (
    "request_id, model, output_tokens, entry_s, admission_s, backend_wait_s, frontend_s, engine_queue_s, "
    "prefill_s, decode_s, delivery_s, e2e_s, ttft_s, client_ttft_s, trace_id"
)


def _answer(
    fut: concurrent.futures.Future[list[Any]], skipped: list[Any]
) -> Callable[[concurrent.futures.Future[None]], None]:
    """A done-callback that answers a batch's intake future once its decisions are stored."""
    return lambda _: fut.set_result(skipped)


class RunawayService:
    def __init__(
        self,
        engine: sa.Engine | None,
        metrics: LedgerMetrics,
        *,
        policy_file: str | None = None,
        tick_s: float = 0.5,
        webhook_options: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self.tick_s = tick_s
        self.policies = PolicyStore(engine, policy_file)
        self.book = CommandBook(
            engine,
            ttl_s=lambda: self.policies.get().commands.ttl_s,
            clock=clock,
            on_delivered=self._delivered,
            on_applied=self._applied,
            on_refused=metrics.commands_refused.inc,
        )
        self.webhooks = (
            Webhooks(engine, on_attempt=self._webhook_attempt, **(webhook_options or {})) if engine else None
        )
        self.rules = RuleEngine(self.policies.get, self, clock=clock)
        self.engine = engine
        self.slo = SloMonitor()
        self._marks: dict[str, int] = {}  # per source, the highest seq the rule engine has seen
        # (batch, its late events or None, the future of its answer, when received, its columns)
        self._intake: queue.Queue[
            tuple[
                ev.Batch, list[Any] | None, concurrent.futures.Future[list[Any]], float | None, Columns | None
            ]
            | None
        ] = queue.Queue()
        self._intake_thread: threading.Thread | None = None
        # The database writes the intake's hooks ask for (``_beside_intake``), run in order on a thread
        # of their own so that the intake never waits on a commit; each with its future.
        self._recorder: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[None]] | None] = (
            queue.Queue()
        )
        self._recorder_thread: threading.Thread | None = None
        # The intake's current batch: the future of storing its last decisions (FIFO: all before too).
        self._decisions_stored: concurrent.futures.Future[None] | None = None
        self._to_observe: deque[tuple[float, str]] = deque()
        self._observed: dict[str, None] = {}
        self.traces: TraceExport | None = None  # the OTLP export of finished requests, when configured
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_slo = 0.0
        self._last_refresh = 0.0
        self._last_flush = 0.0
        live = metrics.live
        live.live = self.rules.live_counts
        live.stalled = self.rules.kv_stalled_counts
        live.stall_max = self.rules.kv_stall_max_s
        if self.webhooks is not None:
            live.outbox = self.webhooks.pending_count

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.policies.load()
        self.book.load()
        if self.webhooks is not None:
            self.webhooks.start()
        self._thread = threading.Thread(target=self._run, name="chunkledger-rules", daemon=True)
        self._thread.start()
        self._recorder_thread = threading.Thread(
            target=self._run_recorder, name="chunkledger-cutoffs", daemon=True
        )
        self._recorder_thread.start()
        self._intake_thread = threading.Thread(
            target=self._run_intake, name="chunkledger-rules-intake", daemon=True
        )
        self._intake_thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._intake_thread is not None:
            self._intake.put(None)
            self._intake_thread.join(10)
        if self._recorder_thread is not None:
            self._recorder.put(None)
            self._recorder_thread.join(10)
        if self._thread is not None:
            self._thread.join(10)
        try:
            self.book.flush()
        except Exception:
            log.exception("could not store the last delivery counts")
        if self.webhooks is not None:
            self.webhooks.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:
                log.exception("rules ticker pass failed")

    def tick(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        self.rules.tick(now)
        expired = self.book.expire(now)
        if expired:
            self.metrics.commands_expired.inc(expired)
        if now - self._last_flush >= 5.0:
            self._last_flush = now
            self.book.flush()
        self._observe_finished(now)
        policy = self.policies.get()
        if now - self._last_slo >= policy.alerts.slo_check_interval_s:
            self._last_slo = now
            for alert in self.slo.check(policy, now):
                self._alert(alert)
        if now - self._last_refresh >= 5.0:
            self._last_refresh = now
            self.policies.refresh()

    # -- ingest hooks -------------------------------------------------------------------------------------
    def observe_arrival(
        self, batch: ev.Batch, received: float | None = None, columns: Columns | None = None
    ) -> concurrent.futures.Future[list[Any]]:
        """Queue a decoded batch for the rule engine; the future gives the events it skipped as at or
        below the source's mark (for ``observe_late`` once the store has said whether they were new).
        ``received``: when the batch was read (``time.monotonic()``), for ``rule_intake_seconds``;
        ``columns``: the columnar message it came as."""
        fut: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self._intake.put((batch, None, fut, received, columns))
        return fut

    def observe_late(self, batch: ev.Batch, events: list[Any]) -> concurrent.futures.Future[list[Any]]:
        """Observe events that arrived at or below the mark and that the store accepted as new."""
        fut: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self._intake.put((batch, events, fut, None, None))
        return fut

    def _run_intake(self) -> None:
        while True:
            item = self._intake.get()
            if item is None:
                return
            batch, late, fut, received, columns = item
            skipped: list[Any] = []
            self._decisions_stored = None
            try:
                if late is None:
                    skipped = self._arrived(batch, columns)
                elif late:
                    self.rules.observe(batch.source, late, self.clock())
            except Exception:
                log.exception("the rule engine failed on a batch from %s", batch.source.id)
            if received is not None:
                self.metrics.rule_intake_seconds.observe(time.monotonic() - received)
            if self._decisions_stored is not None:
                # The batch's answer waits until its decisions are stored, so their commands ride on
                # it; the intake goes on with the next batch meanwhile.
                self._decisions_stored.add_done_callback(_answer(fut, skipped))
            else:
                fut.set_result(skipped)

    def _run_recorder(self) -> None:
        while True:
            item = self._recorder.get()
            if item is None:
                return
            work, done = item
            try:
                work()
            except Exception:
                log.exception("storing what the rule engine reported failed (%s)", work)
            finally:
                done.set_result(None)

    def _arrived(self, batch: ev.Batch, columns: Columns | None = None) -> list[Any]:
        source, events = batch.source, batch.events
        if not events:
            return []
        mark = self._marks.get(source.id, -1)
        if events[0].seq > mark:
            new, old = events, []
        else:
            new = [e for e in events if e.seq > mark]
            old = [e for e in events if e.seq <= mark]
            columns = None  # the rules see part of it: its steps' tokens group from their events
        if new:
            self._marks[source.id] = new[-1].seq
            self.rules.observe(source, new, self.clock(), columns)
        return old

    def on_commit(self, batch: ev.Batch, accepted: int, duplicates: int) -> None:
        m = self.metrics
        sid = m.sources(batch.source.id)
        m.ingest_batches.labels(sid).inc()
        if accepted:
            m.ingest_events.labels(sid).inc(accepted)
        if duplicates:
            m.ingest_duplicates.labels(sid).inc(duplicates)

    # -- rule engine hooks ---------------------------------------------------------------------------
    def _beside_intake(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[None] | None:
        """``fn(*args)`` (a database write) on the recorder thread, in order, when called from the
        intake thread; its future. Now, from any other thread (the ticker, tests)."""
        if threading.current_thread() is self._intake_thread:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._recorder.put((functools.partial(fn, *args), done))
            return done
        fn(*args)
        return None

    def decided(self, decisions: list[Decision]) -> None:
        done = self._beside_intake(self._record, decisions)
        if done is not None:  # the batch that made them is answered once they are stored
            self._decisions_stored = done

    def _record(self, decisions: list[Decision]) -> None:
        """Store decisions and queue their commands (``CommandBook.record``), count them, queue their
        webhooks."""
        alerts = []
        for d, p in self.book.record(decisions):
            self.metrics.cutoffs.labels(d.rule, d.action).inc()
            log.info("cutoff %s: %s -> %s on %s (%s)", p.command.id, d.rule, d.action, d.request_id, d.detail)
            alerts.append(
                CutoffAlert(
                    command_id=p.command.id,
                    request_id=d.request_id,
                    model=d.model,
                    rule=d.rule,
                    action=d.action,
                    detail=d.detail,
                    source_id=d.engine_source_id,
                    gateway_source_id=d.gateway_source_id,
                    decided_ts=d.decided_ts,
                )
            )
        if alerts and self.webhooks is not None:
            try:
                self.webhooks.emit_many(alerts)
            except Exception:
                log.exception("could not queue the cutoff webhooks")

    def confirmed(self, source_id: str, command_id: str, ts: float) -> None:
        self._beside_intake(self.book.confirm, source_id, command_id, ts)

    def request_done(self, request_id: str, source_id: str, kind: str) -> None:
        self._beside_intake(self.book.request_done, request_id, source_id)
        if kind == "finished" and request_id not in self._observed:
            self._observed[request_id] = None
            if len(self._observed) > 100_000:
                self._observed.pop(next(iter(self._observed)))
            self._to_observe.append((self.clock() + OBSERVE_DELAY_S, request_id))

    def gateway_joined(self, request_id: str, source_id: str) -> None:
        self._beside_intake(self.book.add_gateway, request_id, source_id)

    def dropped(self, source: ev.Source, count: int, reason: str, ts: float) -> None:
        m = self.metrics
        m.source_dropped.labels(m.sources(source.id), m.reasons(reason)).inc(count)
        self._beside_intake(
            self._alert,
            DataLossAlert(source_id=source.id, model=source.model, count=count, reason=reason, ts=ts),
        )

    def starving(self, r: R.LiveRequest, waited_s: float, now: float) -> None:
        bound = self.policies.get().alerts.starvation_wait_s
        self._alert(
            StarvationAlert(
                request_id=r.request_id,
                model=r.model,
                source_id=r.engine_source_id,
                waited_s=waited_s,
                bound_s=bound,
                preemptions=r.preemptions,
            )
        )

    # -- command book hooks --------------------------------------------------------------------------
    def _delivered(self, n: int, channel: str) -> None:
        self.metrics.commands_delivered.labels(channel).inc(n)

    def _applied(self, p: Pending, target: str, took_s: float) -> None:
        self.metrics.commands_applied.labels(p.command.rule, target).inc()
        self.metrics.command_apply_seconds.labels(target).observe(max(0.0, took_s))

    def _webhook_attempt(self, event_type: str, status: int | None, reason: str | None, dead: bool) -> None:
        m = self.metrics
        m.webhook_attempts.labels(event_type).inc()
        if reason is not None:
            m.webhook_failures.labels(event_type, reason).inc()
        if dead:
            m.webhook_dead.labels(event_type).inc()

    def _alert(self, alert: Alert, count: bool = True) -> None:
        if count:
            self.metrics.alerts.labels(alert.event_type).inc()
        if self.webhooks is None:
            return
        try:
            self.webhooks.emit(alert)
        except Exception:
            log.exception("could not queue the %s webhook", alert.event_type)

    # -- latency observations ------------------------------------------------------------------------
    def _observe_finished(self, now: float) -> None:
        due: list[str] = []
        while self._to_observe and self._to_observe[0][0] <= now and len(due) < 5000:
            due.append(self._to_observe.popleft()[1])
        if not due or self.engine is None:
            return
        columns = "*" if self.traces is not None else _VIEW_COLUMNS  # the trace export's spans need them all
        stmt = sa.text(f"SELECT {columns} FROM requests WHERE request_id IN :ids").bindparams(
            sa.bindparam("ids", expanding=True)
        )
        with self.engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(stmt, {"ids": due})]
        if self.traces is not None:
            self.traces.offer(rows)
        for row in rows:
            self.metrics.observe_request(row)
            # the SLO is on TTFT as the client saw it where a gateway measured it
            ttft = row.get("client_ttft_s")
            if ttft is None:
                ttft = row.get("ttft_s")
            self.slo.add(
                str(row.get("model") or ""), now, ttft if isinstance(ttft, float) else None, itl_of(row)
            )
