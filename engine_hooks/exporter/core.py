"""``Exporter``: one source's events from its hooks to the ledger, wired from the parts of this package.

The exporter owns the event queue the engine thread emits into (``queue.py``: its ``emitter`` and
``emit`` are the queue's, so emitting costs no more than appending to it) and the rest: the worker
(``batcher.py``, which takes from the queue as a ``WorkerQueue``), its sender threads (``window.py``)
with their transport (``transport.py``), the command poller and de-duplicator (``commands.py``), the
spool and the counters (``stats.py``).
It also handles the process life cycle: a forked child becomes a new source, and every live exporter
is shut down at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from urllib.parse import quote

import httpx
import msgspec

from engine_hooks.config import ExporterConfig
from engine_hooks.events import Source
from engine_hooks.exporter.batcher import Batcher
from engine_hooks.exporter.commands import CommandCallback, CommandDeduper, CommandPoller
from engine_hooks.exporter.encode import Encoder, Prepared
from engine_hooks.exporter.logonce import LogOnce, log
from engine_hooks.exporter.queue import Emitter, EventQueue, Layout
from engine_hooks.exporter.stats import Counters, ExporterStats
from engine_hooks.exporter.transport import Sender, Transport, request_headers
from engine_hooks.exporter.window import Senders
from engine_hooks.spool import Spool, SpoolError, new_producer_key

_live: weakref.WeakSet[Exporter] = weakref.WeakSet()


class KeywordEmit(Protocol):
    """``Exporter.emit``: one event by keyword."""

    def __call__(self, kind: type[Any], **fields: Any) -> None: ...


class Exporter:
    """Sends one source's events to the ledger; see the package docstring.

    ``on_command`` is called on a sender or the command-poll thread with each ``Command`` from the ledger
    (once per command id, never concurrently); it should only hand the command over (e.g. to a queue the
    engine drains) and return.
    ``registry``: a ``prometheus_client.CollectorRegistry`` to expose the self-metrics in.
    """

    emit: KeywordEmit
    """``emit(kind, **fields)``: emit one event by keyword (``ts`` defaults to now). Slower than an
    emitter; never raises. The queue's own method (``EventQueue.emit``), so it costs no extra call."""

    def __init__(
        self,
        config: ExporterConfig,
        *,
        on_command: CommandCallback | None = None,
        registry: Any = None,
    ):
        self.config = config
        self._on_command = on_command
        self._source = Source(id=config.source_id, kind=config.source_kind, model=config.model)
        self._log = LogOnce()
        self._holders: list[Callable[[], None]] = []  # see hold_back
        self._wake = threading.Event()  # wakes the worker: a full batch, an answer, flush, shutdown
        # Emitters hold the queue (never replaced): a forked child restarts it (_after_fork_in_child).
        self._queue = EventQueue(config.queue_size, config.batch_size, self._wake, self._log)
        self.emit = self._queue.emit
        self._init_state(self._open_spool())
        self._start()
        _live.add(self)
        if registry is not None:
            from engine_hooks.metrics import register_exporter

            register_exporter(self, registry)

    @classmethod
    def from_env(
        cls, *, on_command: CommandCallback | None = None, registry: Any = None, **overrides: Any
    ) -> Exporter:
        """An exporter configured from ``CHUNKLEDGER_*`` variables; keyword ``overrides`` win."""
        return cls(ExporterConfig.from_env(**overrides), on_command=on_command, registry=registry)

    def _init_state(self, spool: Spool | None) -> None:
        """State that a forked child re-creates: the worker and its parts."""
        config, log_once = self.config, self._log
        self._stop = threading.Event()
        self._shutdown_started = False
        self._spool = spool
        self._counters = Counters()
        self._commands = CommandDeduper(self._on_command, log_once) if self._on_command is not None else None
        # The producer key binds the source id to this exporter at the ledger (ledger.producers); kept in
        # the spool folder, so a restart with the spool is the same producer.
        self._producer_key = spool.producer_key() if spool is not None else new_producer_key()
        seq_start = config.seq_start if config.seq_start is not None else time.time_ns() // 1000
        transport: Sender
        if config.nats_url:
            from engine_hooks.exporter.jetstream import JetStreamTransport

            transport = stream = JetStreamTransport(
                config, self._counters, log_once, producer_key=self._producer_key
            )
            if self._commands is not None:
                stream.subscribe_commands(self._commands)
        else:
            transport = Transport(config, self._counters, log_once, producer_key=self._producer_key)
        self._encoder = Encoder(
            self._source,
            config.batch_size,
            seq_start,
            log_once,
            self._queue.record_drop,
            columns=lambda: config.wire == "columns" and not transport.columns_refused,
        )
        senders = Senders(
            count=config.max_in_flight,
            name=f"chunkledger-sender-{self._source.id}",
            transport=transport,
            counters=self._counters,
            record_drop=self._queue.record_drop,
            hand_over=self._commands,
            wake=self._wake,
            stop=self._stop,
            log=log_once,
        )
        self._batcher = Batcher(
            config=config,
            queue=self._queue,
            owner=self,
            spool=spool,
            encoder=self._encoder,
            senders=senders,
            counters=self._counters,
            wake=self._wake,
            stop=self._stop,
            log=log_once,
            name=f"chunkledger-exporter-{self._source.id}",
        )
        self._poller: CommandPoller | None = None
        if self._commands is not None and config.command_poll_wait_s > 0 and not config.nats_url:
            self._poller = CommandPoller(
                url=config.url,
                source_id=self._source.id,
                wait_s=config.command_poll_wait_s,
                token=config.ingest_token,
                producer_key=self._producer_key,
                connect_timeout_s=config.connect_timeout_s,
                deliver=self._commands,
                stop=self._stop,
                log=log_once,
            )

    def _open_spool(self) -> Spool | None:
        if not self.config.spool_enabled:
            return None
        assert self.config.spool_dir is not None
        return Spool(
            os.path.join(self.config.spool_dir, self._source.id),
            max_bytes=self.config.spool_max_bytes,
            segment_bytes=self.config.spool_segment_bytes,
            fsync=self.config.spool_fsync,
        )

    def _start(self) -> None:
        self._batcher.start()
        if self._poller is not None:
            self._poller.start()

    @property
    def source(self) -> Source:
        return self._source

    def emitter(self, kind: type[Any], *fields: str) -> Emitter:
        """A fast emit function for ``kind`` taking ``fields`` positionally.

        ``tokens = exporter.emitter(Tokens, "ts", "request_id", "count", "total")`` then
        ``tokens(ts, rid, 3, 10)`` for one event or ``tokens.many([(ts, rid, 3, 10), ...])`` for many.
        Leave ``"ts"`` out to have the wall clock read at emit time. ``seq`` is never passed.
        Raises ValueError here (at setup) for unknown or missing fields; emitting never raises.
        Values (lists too) must not be mutated after they are emitted.
        """
        return self._queue.emitter(kind, *fields)

    def _prepare(self, entries: Iterable[tuple[Layout, Any]]) -> list[Prepared]:
        """Number and encode queue entries (the worker's step; ``bench/exporter.py`` times it)."""
        return self._encoder.prepare(entries)

    # -- host API ---------------------------------------------------------------------------------

    def hold_back(self, release: Callable[[], None]) -> None:
        """Register a producer that holds events back before emitting them (the vLLM plugin folds a
        step's outputs off the engine thread): :meth:`force_flush` and :meth:`shutdown` call
        ``release()``, which emits them, first."""
        self._holders.append(release)

    def _release_held(self) -> None:
        for release in self._holders:
            try:
                release()
            except Exception:
                self._log(
                    logging.ERROR,
                    "release",
                    "chunkledger exporter: a producer's release failed",
                    exc_info=True,
                )

    def force_flush(self, timeout: float | None = None) -> bool:
        """Wait until every event emitted so far (and held back: :meth:`hold_back`) is acknowledged by
        the ledger; False on timeout.

        Spooled events count as not yet delivered, so while the ledger is down this waits out the
        timeout. Never raises.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        self._release_held()
        try:
            batcher = self._batcher
            with batcher.progress:
                while True:
                    self._wake.set()
                    if batcher.drained():
                        return True
                    if self._shutdown_started and not batcher.thread.is_alive():
                        return False
                    remaining = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
                    if remaining <= 0:
                        return False
                    batcher.progress.wait(remaining)
        except Exception:
            self._log(logging.ERROR, "flush", "chunkledger exporter: force_flush() failed", exc_info=True)
            return False

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop accepting events, deliver (or spool) what is queued, stop the worker. Idempotent.

        Returns True when everything was delivered or spooled within ``timeout`` seconds (default
        ``config.shutdown_timeout_s``). Events emitted afterwards are counted as dropped ("shutdown").
        """
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        batcher = self._batcher
        if not self._shutdown_started:
            self._release_held()
        first = self._queue.close()
        self._shutdown_started = True
        if first:
            batcher.send_deadline = time.monotonic() + 0.8 * max(0.0, timeout)  # then spool the rest
            self._stop.set()
            self._wake.set()
        batcher.join(timeout)
        if self._poller is not None:
            with contextlib.suppress(Exception):  # ends a poll held by the ledger
                self._poller.close()
        if batcher.thread.is_alive():
            batcher.shutdown_ok = False
            self._log(
                logging.WARNING, "shutdown", "chunkledger exporter: shutdown timed out after %.1fs", timeout
            )
        elif first and batcher.shutdown_ok and (self._spool is None or not self._spool.pending_events):
            self._release_source()
        return batcher.shutdown_ok

    def _release_source(self) -> None:
        """Nothing is left to send: release the source id from this producer's key (``ledger.producers``),
        so that a successor with another key (a restart without this spool) takes it over at once
        instead of after the ledger's lease. Best effort: the lease still ends it."""
        url = f"{self.config.url.rstrip('/')}/v1/sources/{quote(self._source.id, safe='')}/producer"
        try:
            httpx.delete(
                url,
                headers=request_headers(self.config.ingest_token, self._producer_key),
                timeout=httpx.Timeout(min(2.0, self.config.timeout_s), connect=self.config.connect_timeout_s),
                trust_env=False,
            )
        except httpx.HTTPError as exc:
            log.info("chunkledger exporter: could not release source %s: %s", self._source.id, exc)

    def stats(self) -> ExporterStats:
        """The self-metrics as a snapshot (cheap; safe from any thread)."""
        spool, counters, encoder = self._spool, self._counters, self._encoder
        with counters.lock:  # one consistent snapshot of what the worker and the senders count
            sent, duplicates, batches_sent = counters.sent, counters.duplicates, counters.batches_sent
            attempts, failures, retried = counters.attempts, counters.send_failures, counters.retried
            spooled, replayed, last_success_ts = counters.spooled, counters.replayed, counters.last_success_ts
        next_seq, first_seq = encoder.next_seq, encoder.first_seq
        return ExporterStats(
            source_id=self._source.id,
            queued=self._queue.pending(),
            numbered=next_seq - first_seq,
            last_seq=next_seq - 1 if next_seq > first_seq else None,
            sent=sent,
            duplicates=duplicates,
            batches_sent=batches_sent,
            send_attempts=attempts,
            send_failures=failures,
            retried=retried,
            spooled=spooled,
            replayed=replayed,
            spool_bytes=spool.size_bytes if spool is not None else 0,
            spool_pending=spool.pending_events if spool is not None else 0,
            spool_torn_records=spool.torn_records if spool is not None else 0,
            dropped=self._queue.dropped(),
            commands=self._commands.handed if self._commands is not None else 0,
            last_success_ts=last_success_ts,
            wire="columns" if self._encoder.columns() else "json",
        )

    # -- process life cycle -----------------------------------------------------------------------

    def _after_fork_in_child(self) -> None:
        """The child of a fork becomes a new source ``<id>-<pid>`` with its own queue, worker and spool.

        The parent keeps sending what it had queued; the child must neither re-send it nor share the
        parent's sequence numbers, HTTP connection or spool folder.
        """
        was_closed = self._queue.closed
        self._source = Source(
            id=f"{self.config.source_id[:100]}-{os.getpid()}",
            kind=self._source.kind,
            model=self._source.model,
        )
        self.config = msgspec.structs.replace(self.config, source_id=self._source.id, seq_start=None)
        self._log = LogOnce()
        self._wake = threading.Event()
        self._queue.restart(self._wake, self._log)  # the same queue object: emitters hold it
        if was_closed:
            self._init_state(None)
            self._shutdown_started = True
            return
        try:
            spool = self._open_spool()
        except SpoolError as exc:
            spool = None
            log.error("chunkledger exporter: no spool after fork: %s", exc)
        self._init_state(spool)
        self._start()


def _after_fork() -> None:
    for exporter in list(_live):
        with contextlib.suppress(Exception):
            exporter._after_fork_in_child()


def _shutdown_all() -> None:
    for exporter in list(_live):
        with contextlib.suppress(Exception):
            exporter.shutdown(exporter.config.shutdown_timeout_s)


os.register_at_fork(after_in_child=_after_fork)
atexit.register(_shutdown_all)
