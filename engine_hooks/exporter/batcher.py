"""The worker thread: takes events from the queue, numbers and encodes them, keeps the window of
POSTs in flight, replays the spool (the backlog) and settles outcomes in send order.

Several batches in flight: the ledger answers a POST only after its group commit, which on a loaded box
can take seconds, while its rule engine looks at each batch on arrival. So the worker does not wait for
an answer before sending the next batch: it hands batches to ``max_in_flight`` sender threads
(``window.py``) and keeps a window of at most ``max_in_flight`` batches counted from the oldest
unanswered one (a full batch goes out as soon as the window has room; a partial one behind others waits
for the flush timer). Everything that decides order stays on this thread:

* It settles outcomes strictly in the order it sent the batches.
* When batch k fails for good while k+1 was acknowledged, k+1 stays delivered and k joins the backlog
  (the spool): it is replayed when the ledger answers again and the ledger stores it below the source's
  high-water mark, checked against stored events. Both are delivered once; the ledger dedupes
  (source_id, seq) should an answer have been lost.
* Only the worker touches the spool, and it keeps a fresh batch (spools it) only once no older batch is
  in flight, so the spool holds batches in seq order. The backlog is replayed oldest first with no
  fresh batch in flight: consecutive spooled batches are merged into POSTs of up to
  ``replay_max_events`` (one probe after a failure, then ``max_in_flight`` at a time, read ahead of
  the ones out), and the spool is released up to a POST only once it and every one before it were
  taken; after a failure the rest of the window is sent again (the ledger dedupes). A merged POST the
  ledger refuses (4xx) is sent again batch by batch, so only the batch it refuses is dropped. Fresh
  batches wait in the queue behind the backlog, and past half the queue go to the spool behind it.
* With ``max_in_flight=1`` the window is one batch: the next POST starts after the previous answer and
  the ledger stores batches in seq order.
* ``force_flush`` waits for the batches in flight; ``shutdown`` gives each batch one attempt until 80%
  of its timeout, then stops waiting for the answers still out and spools those batches (a late answer
  is ignored; if the ledger did store the batch, the replay is counted as duplicates).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque

from engine_hooks.config import ExporterConfig
from engine_hooks.exporter.encode import Encoder, Prepared, merge_records
from engine_hooks.exporter.logonce import LogOnce, log
from engine_hooks.exporter.queue import WorkerQueue
from engine_hooks.exporter.stats import Counters
from engine_hooks.exporter.transport import Outcome, backoff
from engine_hooks.exporter.window import FRESH, HELD, SPOOLED, Job, Senders
from engine_hooks.spool import Spool, SpoolPos

_TAKE_CHUNKS = 4  # batches the worker numbers and encodes per take


class Batcher:
    """The worker of one exporter (see the module docstring); ``start()`` runs it on its own thread."""

    def __init__(
        self,
        *,
        config: ExporterConfig,
        queue: WorkerQueue,
        owner: object,
        spool: Spool | None,
        encoder: Encoder,
        senders: Senders,
        counters: Counters,
        wake: threading.Event,
        stop: threading.Event,
        log: LogOnce,
        name: str,
    ):
        self._config = config
        self._queue = queue
        # The exporter lives as long as its worker runs, as when it was the queue itself: a host may
        # keep only its emitters, and the fork and exit hooks (core._live) hold exporters weakly.
        self._owner = owner
        self.spool = spool
        self.encoder = encoder
        self._senders = senders
        self._counters = counters
        self._wake = wake
        self._stop = stop
        self._log = log
        self._batch_size = config.batch_size
        self._max_in_flight = config.max_in_flight
        self._held: deque[Prepared] = deque()  # batches neither delivered nor spooled (spool full/off)
        self._ready: deque[Prepared] = deque()  # numbered and encoded, not yet sent or kept
        self._inflight: deque[Job] = deque()  # sent and not yet settled, oldest first
        self._replay_pos: SpoolPos | None = None  # where the next replay reads (None: the spool's head)
        self._replay_broken = False  # a replay in the window failed: later ones are not released
        self._replay_single_until: SpoolPos | None = None  # a merged replay was refused: one record
        # per POST until past this position, so that only the record the ledger refuses is dropped
        self._next_partial = 0.0  # monotonic time from which a partial batch may follow ones in flight
        self._down_until = 0.0  # monotonic time before which the ledger is not tried (backoff)
        self._failures = 0  # consecutive failed POSTs
        self.send_deadline = 0.0  # shutdown: one attempt per batch until then, then spool the rest
        self.progress = threading.Condition()  # notified after each cycle (force_flush waits on it)
        self._in_cycle = False
        self.shutdown_ok = True
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()
        self._senders.start()

    def drained(self) -> bool:
        """Nothing left to deliver: no event queued, numbered, in flight or spooled."""
        return not (
            self._in_cycle
            or self._queue.pending()
            or self._queue.marker_due()
            or self._held
            or self._ready
            or self._inflight
            or (self.spool is not None and self.spool)
        )

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._sleep_time())
            self._wake.clear()
            if self._stop.is_set():
                break
            self._guarded_cycle(final=False)
        self._guarded_cycle(final=True)
        self._report_spooled()
        self._close_resources()

    def _sleep_time(self) -> float:
        """How long the worker may sleep; an answer, a full batch or shutdown wakes it earlier."""
        inflight = self._inflight
        if inflight and inflight[0].done:
            return 0.0
        flush = self._config.flush_interval_s
        if not (self._backlog() or self._queue.pending() or self._ready):
            return flush
        now = time.monotonic()
        wait = self._down_until - now
        if wait > 0:  # the ledger is backing off: keep (spool) what is queued meanwhile
            return min(flush, wait)
        if self._backlog():
            return flush if inflight else 0.0
        if len(inflight) >= self._max_in_flight:
            return flush
        if self._ready or self._queue.pending() >= self._batch_size:
            return 0.0
        if inflight:  # a partial batch follows the ones in flight on the flush timer
            return min(flush, max(self._next_partial - now, 0.001))
        return 0.001

    def _guarded_cycle(self, final: bool) -> None:
        with self.progress:
            self._in_cycle = True
        try:
            if final:
                self._final_cycle()
            else:
                self._cycle(time.monotonic() + 0.5)
        except Exception:
            self._log(logging.ERROR, "cycle", "chunkledger exporter: worker error", exc_info=True)
        finally:
            with self.progress:
                self._in_cycle = False
                self.progress.notify_all()

    def _cycle(self, until: float) -> None:
        """Step the worker until it has to wait (for an answer, the backoff or events) or ``until``."""
        self._queue.place_marker()
        while time.monotonic() < until and not self._stop.is_set() and self._step(final=False):
            pass

    def _final_cycle(self) -> None:
        """Shutdown: one attempt per batch until the send deadline, then spool what is left.

        Batches still unanswered at the deadline are given up on: fresh ones go to the spool (the ledger
        may still store them; a later replay is then counted as duplicates), a replayed record stays in
        the spool.
        """
        deadline = self.send_deadline
        self._queue.place_marker(force=True)
        while True:
            if self._step(final=True):
                continue
            if not self._inflight:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._abandon_in_flight()
                continue
            self._wake.wait(remaining)  # a sender sets it when an answer arrives
            self._wake.clear()
        lost = sum(p.events for p in self._held) + sum(p.events for p in self._ready)
        lost += self._queue.pending()
        if lost:
            self._queue.discard()
            self._held.clear()
            self._ready.clear()
            self._queue.record_drop("shutdown", lost, report=False)
            self.shutdown_ok = False
            log.error(
                "chunkledger exporter %s: %d events could be neither delivered nor spooled at shutdown",
                self._config.source_id,
                lost,
            )

    def _report_spooled(self) -> None:
        """Shutdown: say what stays in the spool for the next start of this source."""
        spool = self.spool
        if spool is not None and spool:
            log.warning(
                "chunkledger exporter %s: %d events (%d batches) stay spooled in %s; they are sent when "
                "source %s starts again with this spool folder",
                self._config.source_id,
                spool.pending_events,
                spool.pending_records,
                spool.directory,
                self._config.source_id,
            )

    def _close_resources(self) -> None:
        self._senders.close()
        if self.spool is not None:
            with contextlib.suppress(Exception):
                self.spool.close()

    def join(self, timeout: float | None) -> None:
        """Wait for the worker to end (not from the worker itself, nor when it never started)."""
        thread = self.thread
        if thread.ident is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # -- one step ---------------------------------------------------------------------------------

    def _backlog(self) -> bool:
        return bool(self._held) or bool(self.spool)

    def _step(self, final: bool) -> bool:
        """One move of the worker (see the module docstring); False when it has to wait.

        Settles answered batches oldest first, then either replays the backlog (one batch at a time,
        nothing else in flight), keeps fresh batches behind it (spool), or sends the next fresh batch
        when the window has room.
        """
        progressed = self._collect()
        now = time.monotonic()
        gate_closed = now < self._down_until or (final and now >= self.send_deadline)
        if gate_closed or self._backlog():
            inflight = self._inflight
            if not gate_closed and all(j.kind == SPOOLED for j in inflight):
                # Replay: up to max_in_flight POSTs of merged spool records. Fresh events wait in the
                # queue behind the backlog; past half the queue they are spooled behind it.
                # After a failure one replay probes the ledger; the window opens once it is taken.
                window = 1 if self._failures else self._max_in_flight
                if len(inflight) < window and self._submit_replay():
                    return True
                if (
                    inflight
                    and not self._held  # the spool took the last one: held batches would pile up
                    and self._queue.pending() >= self._config.queue_size // 2
                ):
                    if not self._ready:
                        self._fill_ready()
                    if self._ready:
                        self._keep(self._ready.popleft())
                        return True
                return progressed or not (inflight or self._backlog())
            if inflight:
                return progressed  # their outcomes come first, so that the spool stays in seq order
            # the ledger is backing off (or shutdown's send deadline passed): keep fresh batches
            if not self._ready and not self._held and self._queue.pending():
                self._fill_ready()
                progressed = True
            if self._ready:
                self._keep(self._ready.popleft())
                return True
            return progressed
        if len(self._inflight) >= self._max_in_flight:
            return progressed
        if not self._ready:
            if not self._queue.pending():
                return progressed
            partial = self._queue.pending() < self._batch_size
            if self._inflight and partial and now < self._next_partial:
                return progressed  # a partial batch behind others waits for the flush timer
            self._next_partial = now + self._config.flush_interval_s
            self._fill_ready()
            if not self._ready:
                return True  # everything taken was invalid (counted as dropped)
        self._submit(FRESH, self._ready.popleft(), 1 if final else self._config.max_attempts)
        return True

    def _fill_ready(self) -> None:
        self._ready.extend(self.encoder.prepare(self._queue.take(self._batch_size * _TAKE_CHUNKS)))

    def _submit(
        self, kind: int, prepared: Prepared, attempts: int, end: SpoolPos | None = None, records: int = 1
    ) -> None:
        job = Job(kind, prepared, attempts, end, records)
        self._inflight.append(job)
        self._senders.submit(job)

    def _submit_replay(self) -> bool:
        """Send the next backlog batch: spool records after those in flight, merged up to
        ``replay_max_events``, else (nothing in flight) the oldest held batch. False when none."""
        spool = self.spool
        replaying = any(j.kind == SPOOLED for j in self._inflight)
        if not replaying:  # the window is empty: read from the head (again, after a failure)
            self._replay_pos, self._replay_broken = None, False
        if spool is not None and spool and not self._replay_broken:
            single = self._replay_single_until is not None
            got = spool.read(
                self._replay_pos,
                max_events=0 if single else self._config.replay_max_events,
                max_bytes=self._config.replay_max_bytes,
            )
            torn_records, torn_events = spool.take_torn()
            if torn_records:
                self._queue.record_drop("spool_torn", torn_events)
            if got.records:
                body, used, events = merge_records(got.records)
                end = got.ends[used - 1] if used < len(got.records) else got.end
                self._replay_pos = end
                until = self._replay_single_until
                if until is not None and end >= until:
                    self._replay_single_until = None
                self._submit(SPOOLED, Prepared(body, events, -1, -1), 1, end, used)
                return True
            if not replaying and got.end != spool.head():
                spool.release(got.end, 0, 0)  # only torn records were left
        if replaying:
            return False
        if self._held:
            self._submit(HELD, self._held[0], 1)
            return True
        self._queue.count_overflow_as("queue_full")
        return False

    # -- outcomes ---------------------------------------------------------------------------------

    def _collect(self) -> bool:
        """Settle the answered batches at the head of the window, in the order they were sent."""
        inflight = self._inflight
        settled = False
        while inflight and inflight[0].done:
            self._settle(inflight.popleft())
            settled = True
        return settled

    def _settle(self, job: Job) -> None:
        """Act on a batch's outcome (its counters and commands were done by its sender)."""
        result = job.result
        assert result is not None
        outcome = result.outcome
        if outcome is Outcome.RETRY:  # not taken: a fresh batch joins the backlog, a replayed one stays
            if job.kind == FRESH:
                if time.monotonic() >= self._down_until:  # one backoff step per outage, not per batch
                    self._enter_down(None)
                self._keep(job.prepared)
            else:
                if job.kind == SPOOLED:
                    self._replay_broken = True  # its records stay; the ones after it are sent again
                self._enter_down(result.retry_after)
            return
        if outcome is Outcome.ACKED:
            self._failures = 0
            self._down_until = 0.0
        if job.kind == SPOOLED:
            assert self.spool is not None and job.end is not None
            if outcome is Outcome.SPLIT:
                self._replay_broken = True
                self._replay_single_until = job.end
            elif not self._replay_broken:  # settled oldest first: everything before it is released
                self.spool.release(job.end, job.records, job.prepared.events)
                self._count_replayed(job.prepared.events)
        elif job.kind == HELD:
            self._held.popleft()
            self._count_replayed(job.prepared.events)

    def _count_replayed(self, events: int) -> None:
        """A replayed batch leaves the backlog (delivered or refused for good): counted once here, not
        per POST, since a replay broken by a batch before it sends the later ones again."""
        with self._counters.lock:
            self._counters.replayed += events

    def _abandon_in_flight(self) -> None:
        """Shutdown's send deadline passed: stop waiting; spool the fresh batches still unanswered."""
        while self._inflight:
            job = self._inflight.popleft()
            with self._counters.lock:
                job.abandoned = job.result is None  # its sender ignores the answer from now on
            if not job.abandoned:
                self._settle(job)
            elif job.kind == FRESH:
                self._keep(job.prepared)

    def _keep(self, prepared: Prepared) -> None:
        """Append to the spool; hold in memory when it is full or off (the queue then fills up)."""
        if not self._held and self.spool is not None:
            try:
                if self.spool.append(prepared.body, prepared.events):
                    with self._counters.lock:
                        self._counters.spooled += prepared.events
                    return
                self._log(logging.WARNING, "spool_full", "chunkledger exporter: the spool is full")
            except OSError as exc:
                self._log(
                    logging.ERROR, "spool_write", "chunkledger exporter: cannot write the spool: %s", exc
                )
        self._held.append(prepared)
        self._queue.count_overflow_as("spool_full" if self.spool is not None else "queue_full")

    def _enter_down(self, hint: float | None) -> None:
        """The ledger did not take a batch: try again only after a growing, jittered delay."""
        self._down_until = time.monotonic() + backoff(self._config, self._failures, hint)
        self._failures = min(self._failures + 1, 30)
