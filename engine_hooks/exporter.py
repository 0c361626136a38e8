"""The engine-side exporter: a non-blocking, lossless path from a source's hooks to the ledger.

Shape (OpenTelemetry's BatchProcessor, plus a disk spool and a window of POSTs in flight)::

    engine thread            worker thread (daemon)                 sender threads (max_in_flight)
    emit -> bounded deque -> take -> number (seq) -> encode
            (never blocks,        |  window has room, no backlog: ---->  POST /v1/events, retries with
             never raises)        |                                      backoff + jitter; counts the answer
                                  |  settle outcomes oldest first  <---  commands -> on_command (host)
                                  |    failed fresh batch -> spool (the backlog)
                                  |  backlog: replay it oldest first, spooled batches merged into
                                  |    POSTs of replay_max_events, max_in_flight at a time
                                  v  ledger backing off: fresh batches go to the spool behind the backlog

The hot path is a closure that appends ``(layout, values)`` to a deque after one length check: no
Struct is built, nothing is encoded and no lock is taken on the engine thread. ``emitter(...).many(rows)``
hands a whole step's rows in one call, which costs about as much as the host appending those rows to
a list of its own.

Several batches in flight: the ledger answers a POST only after its group commit, which on a loaded box
can take seconds, while its rule engine looks at each batch on arrival. So the worker does not wait for
an answer before sending the next batch: it hands batches to ``max_in_flight`` sender threads and keeps
a window of at most ``max_in_flight`` batches counted from the oldest unanswered one (a full batch goes
out as soon as the window has room; a partial one behind others waits for the flush timer). Everything
that decides order stays on the worker thread:

* The worker settles outcomes strictly in the order it sent the batches. A sender only POSTs (retrying a
  fresh batch ``max_attempts`` times), counts the answer under a lock and hands the answer's commands
  over (once per command id, under ``_command_lock``) as soon as it arrives, not in batch order.
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
  the ledger stores batches in seq order, as before this window existed.
* ``force_flush`` waits for the batches in flight; ``shutdown`` gives each batch one attempt until 80%
  of its timeout, then stops waiting for the answers still out and spools those batches (a late answer
  is ignored; if the ledger did store the batch, the replay is counted as duplicates).

Sequence numbers: the order of events is fixed when they are emitted (one FIFO deque); the worker
numbers them in that order as it takes them, before the first send attempt, and a number never changes
afterwards (retries and spool replays re-send the same bytes). The first number is ``seq_start`` or the
current time in microseconds, so a restarted source continues above its previous run.

Drops happen only when the queue is full (the worker cannot keep up, or it is holding back because the
ledger is down and the spool is full or disabled), when the ledger rejects a batch (HTTP 4xx other than
401/403/404/408/429), when an event cannot be built or fails the contract's validation, or when a spool
record is found torn. Each is counted by reason, and the next delivered batch carries a ``dropped``
marker event (one per reason, each with a seq of its own) so the ledger shows the hole.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import random
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol, cast

import httpx
import msgspec

from engine_hooks.config import ExporterConfig
from engine_hooks.events import (
    Batch,
    Command,
    Dropped,
    Event,
    Source,
    batch_encoder,
    commands_decoder,
    response_decoder,
)
from engine_hooks.spool import Spool, SpoolError, SpoolPos, SpoolRecord

log = logging.getLogger(__name__)

CommandCallback = Callable[[Command], None]

_batch_validator = msgspec.json.Decoder(Batch)
_event_validator = msgspec.json.Decoder(Event)
_RETRY_STATUSES = frozenset({401, 403, 404, 408, 429})  # 401/403/404: the ledger or our config is wrong,
# not the batch: keep it (spool) so that it is delivered once that is fixed, instead of dropping it.
_COMMAND_MEMORY = 4096  # command ids remembered to hand each command to the host once
_TAKE_CHUNKS = 4  # batches the worker numbers and encodes per take
_FRESH, _SPOOLED, _HELD = 0, 1, 2  # what a job sends: a fresh batch, spooled records, _held[0]
_ACKED, _REJECTED = "acked", "rejected"  # a job's outcome; a float instead: it failed (retry hint, s)
_SPLIT = "split"  # a merged replay was refused: its records are sent again one per POST


class _RawBatch(msgspec.Struct):
    """A spooled body, its events left encoded (to merge consecutive records into one POST)."""

    source: msgspec.Raw
    events: list[msgspec.Raw]
    schema_version: int = 1


_raw_batch = msgspec.json.Decoder(_RawBatch)


def merge_records(records: Sequence[SpoolRecord]) -> tuple[bytes, int, int]:
    """One body from the longest prefix of ``records`` that shares its source and schema version.

    Returns (body, records used, events). The events keep their seq order (the spool holds batches in
    seq order), so the ledger takes the merged batch as it would take the records one by one.
    """
    if len(records) == 1:
        return records[0].payload, 1, records[0].events
    first = _raw_batch.decode(records[0].payload)
    events = list(first.events)
    used, count = 1, records[0].events
    for record in records[1:]:
        nxt = _raw_batch.decode(record.payload)
        if bytes(nxt.source) != bytes(first.source) or nxt.schema_version != first.schema_version:
            break
        events.extend(nxt.events)
        used += 1
        count += record.events
    if used == 1:
        return records[0].payload, 1, records[0].events
    body = b"".join(
        (
            b'{"source":',
            bytes(first.source),
            b',"events":[',
            b",".join(bytes(e) for e in events),
            b'],"schema_version":',
            str(first.schema_version).encode(),
            b"}",
        )
    )
    return body, used, count


class _Layout(NamedTuple):
    """How the values of a queue entry become events."""

    kind: type[Any]
    fields: tuple[str, ...]
    build: Callable[[int, Any], Event]  # (seq, values) -> event
    many: bool  # values is a sequence of rows, not one row


class Prepared(NamedTuple):
    """A numbered, encoded batch: what is POSTed and, when that fails, spooled."""

    body: bytes
    events: int
    first_seq: int
    last_seq: int
    markers_only: bool = False


class _Job:
    """One batch handed to a sender thread; the worker settles jobs in the order it submitted them."""

    __slots__ = ("abandoned", "attempts", "done", "end", "kind", "outcome", "prepared", "records")

    def __init__(
        self, kind: int, prepared: Prepared, attempts: int, end: SpoolPos | None = None, records: int = 1
    ):
        self.kind = kind
        self.prepared = prepared
        self.end = end  # spooled: the spool position just past its records (released once acknowledged)
        self.records = records  # spooled: how many spool records it merges
        self.attempts = attempts  # POSTs before giving up: max_attempts for a fresh batch, else 1
        self.outcome: str | float | None = None  # set under _counts_lock once the answer is known
        self.done = False  # set after the outcome, once the answer's commands are handed over
        self.abandoned = False  # shutdown's deadline came first: spooled, its answer is ignored


class Emitter(Protocol):
    """A fast emit function for one event kind and a fixed field order (see ``Exporter.emitter``)."""

    kind: type[Any]
    fields: tuple[str, ...]

    def __call__(self, *values: Any) -> None: ...

    def many(self, rows: Sequence[Sequence[Any]]) -> None: ...


class ExporterStats(msgspec.Struct, kw_only=True, frozen=True):
    """A snapshot of an exporter's self-metrics (``Exporter.stats()``)."""

    source_id: str
    queued: int  # events in memory waiting for the worker
    numbered: int  # events given a seq so far (markers included)
    last_seq: int | None  # the last seq given, None before the first
    sent: int  # events the ledger acknowledged (stored now or before)
    duplicates: int  # of those, events the ledger already had (re-sent after a lost answer)
    batches_sent: int  # acknowledged POSTs
    send_attempts: int  # POSTs tried
    send_failures: int  # POSTs that failed (error status, timeout, refused connection)
    retried: int  # retries of a fresh batch after a failure (before it is spooled)
    spooled: int  # events written to the spool
    replayed: int  # events delivered from the spool (or from memory after the spool was full)
    spool_bytes: int  # bytes the spool uses on disk
    spool_pending: int  # events waiting in the spool
    spool_torn_records: int  # damaged spool records skipped (their events are counted as dropped)
    dropped: dict[str, int]  # events dropped, by reason
    commands: int  # commands handed to the host callback
    last_success_ts: float | None  # wall time of the last acknowledged POST


class _LogOnce:
    """Logs each distinct problem once, then at most every ``interval_s`` with a count of repeats."""

    def __init__(self, interval_s: float = 60.0):
        self._interval_s = interval_s
        self._seen: dict[str, tuple[float, int]] = {}
        self._mutex = threading.Lock()  # the worker, the senders and the poller log

    def __call__(self, level: int, key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._mutex:
            last, suppressed = self._seen.get(key, (-1e18, 0))
            if now - last < self._interval_s:
                self._seen[key] = (last, suppressed + 1)
                return
            self._seen[key] = (now, 0)
        if suppressed:
            msg += f" ({suppressed} similar messages suppressed)"
        log.log(level, msg, *args, exc_info=exc_info)


def _make_builder(kind: type[Any], fields: tuple[str, ...]) -> Callable[[int, Any], Event]:
    """A function (seq, row) -> kind(seq=seq, f0=row[0], ...), generated once per emitter.

    Field names were checked against the Struct's fields, so the generated source is safe.
    """
    args = ", ".join(f"{name}=v[{i}]" for i, name in enumerate(fields))
    source = (
        "def build(seq, v):\n"
        f"    if len(v) != {len(fields)}:\n"
        f"        raise TypeError(f'expected {len(fields)} values, got {{len(v)}}')\n"
        f"    return kind(seq=seq, {args})\n"
    )
    namespace: dict[str, Any] = {"kind": kind}
    exec(source, namespace)
    return cast(Callable[[int, Any], Event], namespace["build"])


def _build_keywords(kind: type[Any]) -> Callable[[int, Any], Event]:
    def build(seq: int, fields: dict[str, Any]) -> Event:
        return cast(Event, kind(seq=seq, **fields))

    return build


def _build_marker(seq: int, values: tuple[float, str, int, float]) -> Event:
    ts, reason, count, first_ts = values
    return Dropped(seq=seq, ts=ts, count=count, reason=reason, first_ts=first_ts)


_MARKER = _Layout(Dropped, ("ts", "reason", "count", "first_ts"), _build_marker, True)

_live: weakref.WeakSet[Exporter] = weakref.WeakSet()


class Exporter:
    """Sends one source's events to the ledger; see the module docstring.

    ``on_command`` is called on a sender or the command-poll thread with each ``Command`` from the ledger
    (once per command id, never concurrently); it should only hand the command over (e.g. to a queue the
    engine drains) and return.
    ``registry``: a ``prometheus_client.CollectorRegistry`` to expose the self-metrics in.
    """

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
        self._queue: deque[tuple[_Layout, Any]] = deque()
        self._queue_size = config.queue_size
        self._batch_size = config.batch_size
        self._log = _LogOnce()
        self._init_state()
        self._spool = self._open_spool()
        self._start_worker()
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

    def _init_state(self) -> None:
        """State that a forked child re-creates (locks, counters, worker bookkeeping)."""
        self._lock = threading.Lock()  # guards _extra, _limit, drops; the fast path takes no lock
        self._extra = 0  # events in queued many-entries beyond one per entry
        self._limit = self._batch_size  # fast-path threshold: at it, emit takes the slow path
        self._closed = False
        self._overflow_reason = "queue_full"  # drop reason while the queue is full; "spool_full" when the
        # worker holds batches back because the spool is full
        self._drops_pending: dict[str, list[float]] = {}  # reason -> [count, first_ts]
        self._dropped: dict[str, int] = {}
        self._next_seq = (
            self.config.seq_start if self.config.seq_start is not None else time.time_ns() // 1000
        )
        self._first_seq = self._next_seq
        self._held: deque[Prepared] = deque()  # batches neither delivered nor spooled (spool full/off)
        self._ready: deque[Prepared] = deque()  # numbered and encoded, not yet sent or kept
        self._inflight: deque[_Job] = deque()  # sent and not yet settled, oldest first
        self._replay_pos: SpoolPos | None = None  # where the next replay reads (None: the spool's head)
        self._replay_broken = False  # a replay in the window failed: later ones are not released
        self._replay_single_until: SpoolPos | None = None  # a merged replay was refused: one record
        # per POST until past this position, so that only the record the ledger refuses is dropped
        self._max_in_flight = self.config.max_in_flight
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # worker -> sender threads
        self._senders: list[threading.Thread] = []
        self._next_partial = 0.0  # monotonic time from which a partial batch may follow ones in flight
        self._down_until = 0.0  # monotonic time before which the ledger is not tried (backoff)
        self._failures = 0  # consecutive failed POSTs
        self._commands_seen: OrderedDict[str, None] = OrderedDict()
        self._command_lock = threading.Lock()  # the worker and the command poller both hand commands over
        self._poller: threading.Thread | None = None
        self._poll_client: httpx.Client | None = None
        self._counts_lock = threading.Lock()  # the counters below: written by the worker and the senders
        self._sent = self._duplicates = self._batches_sent = 0
        self._attempts = self._send_failures = self._retried = 0
        self._spooled = self._replayed = self._commands = 0
        self._last_success_ts: float | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._stop_deadline = 0.0
        self._send_deadline = 0.0
        self._progress = threading.Condition()
        self._in_cycle = False
        self._shutdown_started = False
        self._shutdown_ok = True
        self._client = self._make_client()

    def _make_client(self) -> httpx.Client:
        headers = {"content-type": "application/json"}
        if self.config.ingest_token:
            headers["authorization"] = f"Bearer {self.config.ingest_token}"
        return httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(self.config.timeout_s, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=self.config.max_in_flight,  # one per sender (the poller has its own client)
                max_keepalive_connections=self.config.max_in_flight,
                keepalive_expiry=30.0,
            ),
            trust_env=False,
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

    def _start_worker(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"chunkledger-exporter-{self._source.id}", daemon=True
        )
        self._thread.start()
        for i in range(self._max_in_flight):
            sender = threading.Thread(
                target=self._send_loop,
                args=(self._jobs,),
                name=f"chunkledger-sender-{self._source.id}-{i}",
                daemon=True,
            )
            sender.start()
            self._senders.append(sender)
        if self._on_command is not None and self.config.command_poll_wait_s > 0:
            self._poller = threading.Thread(
                target=self._poll_commands, name=f"chunkledger-commands-{self._source.id}", daemon=True
            )
            self._poller.start()

    def _poll_commands(self) -> None:
        """Long-poll ``GET /v1/commands`` until shutdown (its own connection, beside the POSTs).

        Commands also ride on ingest answers, but an answer comes only after the ledger has stored
        the batch: when its commits slow down, or when nothing is emitted, the poll still brings a
        cutoff within milliseconds of the decision.
        """
        wait_s = self.config.command_poll_wait_s
        url = self.config.url.rstrip("/") + "/v1/commands"
        headers = {"authorization": f"Bearer {self.config.ingest_token}"} if self.config.ingest_token else {}
        client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(wait_s + 10.0, connect=self.config.connect_timeout_s),
            trust_env=False,
        )
        self._poll_client = client
        backoff = 0.5
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    response = client.get(url, params={"source_id": self._source.id, "wait_s": wait_s})
                    if response.status_code == 404:  # a ledger without the endpoint: look again later
                        self._stop.wait(30.0)
                        continue
                    response.raise_for_status()
                    answer = commands_decoder.decode(response.content)
                except (httpx.HTTPError, msgspec.DecodeError, RuntimeError) as exc:
                    if self._stop.is_set():
                        return
                    self._log(
                        logging.WARNING,
                        "poll",
                        "chunkledger exporter: polling %s for commands failed: %s",
                        url,
                        exc,
                    )
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 10.0)
                    continue
                backoff = 0.5
                for command in answer.commands:
                    self._hand_over(command)
                if not answer.commands and time.monotonic() - started < wait_s / 2:
                    self._stop.wait(1.0)  # a ledger that does not hold the poll: do not spin
        finally:
            client.close()

    # -- engine-side API --------------------------------------------------------------------------

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
        struct_fields = set(getattr(kind, "__struct_fields__", ()))
        if not struct_fields or "seq" not in struct_fields:
            raise ValueError(f"{kind!r} is not an event type of engine_hooks.events")
        unknown = [f for f in fields if f not in struct_fields or f == "seq"]
        if unknown or len(set(fields)) != len(fields):
            raise ValueError(f"{kind.__name__}: unknown, repeated or reserved fields {unknown or fields}")
        required = {f.name for f in msgspec.structs.fields(kind) if f.required}
        missing = required - set(fields) - {"seq", "ts"}
        if missing:
            raise ValueError(f"{kind.__name__}: required fields not covered: {sorted(missing)}")
        stamp = "ts" not in fields
        names = ("ts", *fields) if stamp else fields
        build = _make_builder(kind, names)
        one, many = _Layout(kind, names, build, False), _Layout(kind, names, build, True)
        queue, append, admit, clock = self._queue, self._queue.append, self._admit, time.time
        exporter = self

        if stamp:

            def emit(*values: Any) -> None:
                values = (clock(), *values)
                if len(queue) + exporter._extra < exporter._limit:
                    append((one, values))
                else:
                    admit(one, values, 1)

            def emit_many(rows: Sequence[Sequence[Any]]) -> None:
                try:
                    now = clock()
                    admit(many, [(now, *row) for row in rows], len(rows))
                except Exception:
                    exporter._log(
                        logging.ERROR, "many", "chunkledger exporter: bad rows for %s", kind, exc_info=True
                    )

        else:

            def emit(*values: Any) -> None:
                if len(queue) + exporter._extra < exporter._limit:
                    append((one, values))
                else:
                    admit(one, values, 1)

            def emit_many(rows: Sequence[Sequence[Any]]) -> None:
                try:
                    admit(many, rows, len(rows))
                except Exception:
                    exporter._log(
                        logging.ERROR, "many", "chunkledger exporter: bad rows for %s", kind, exc_info=True
                    )

        fn = cast(Any, emit)
        fn.many, fn.kind, fn.fields = emit_many, kind, fields
        return cast(Emitter, fn)

    def emit(self, kind: type[Any], **fields: Any) -> None:
        """Emit one event by keyword (``ts`` defaults to now). Slower than an emitter; never raises."""
        try:
            if "ts" not in fields:
                fields["ts"] = time.time()
            layout = _KEYWORD_LAYOUTS.get(kind)
            if layout is None:
                layout = _KEYWORD_LAYOUTS.setdefault(kind, _Layout(kind, (), _build_keywords(kind), False))
            if len(self._queue) + self._extra < self._limit:
                self._queue.append((layout, fields))
            else:
                self._admit(layout, fields, 1)
        except Exception:
            self._log(logging.ERROR, "emit", "chunkledger exporter: emit() failed", exc_info=True)

    def _admit(self, layout: _Layout, values: Any, n: int) -> None:
        """Slow path of emit: wakes the worker at a full batch, counts drops, places the drop marker."""
        if n <= 0:
            return
        try:
            with self._lock:
                if self._closed:
                    self._dropped["shutdown"] = self._dropped.get("shutdown", 0) + n
                    return
                queue = self._queue
                occupancy = len(queue) + self._extra
                if occupancy + n > self._queue_size:
                    self._count_drop_locked(self._overflow_reason, n, time.time())
                    self._limit = 0  # every emit takes this path until the marker is placed
                    return
                if self._drops_pending:
                    queue.append((_MARKER, self._take_drops_locked()))
                queue.append((layout, values))
                self._extra += n - 1
                if occupancy + n >= self._batch_size:
                    self._limit = self._queue_size
                    self._wake.set()
                else:
                    self._limit = self._batch_size
        except Exception:
            self._log(logging.ERROR, "admit", "chunkledger exporter: emit() failed", exc_info=True)

    def _count_drop_locked(self, reason: str, n: int, ts: float, report: bool = True) -> None:
        self._dropped[reason] = self._dropped.get(reason, 0) + n
        if report:
            pending = self._drops_pending.setdefault(reason, [0, ts])
            pending[0] += n

    def _take_drops_locked(self) -> list[tuple[float, str, int, float]]:
        now = time.time()
        rows = [
            (now, reason, int(count), first_ts) for reason, (count, first_ts) in self._drops_pending.items()
        ]
        self._drops_pending = {}
        return rows

    def _record_drop(self, reason: str, n: int, report: bool = True) -> None:
        """A drop found by the worker: counted now, marker placed at the worker's next cycle."""
        if n <= 0:
            return
        with self._lock:
            self._count_drop_locked(reason, n, time.time(), report)
        self._log(
            logging.WARNING, f"drop:{reason}", "chunkledger exporter: dropped %d events (%s)", n, reason
        )

    # -- host API ---------------------------------------------------------------------------------

    def force_flush(self, timeout: float | None = None) -> bool:
        """Wait until every event emitted so far is acknowledged by the ledger; False on timeout.

        Spooled events count as not yet delivered, so while the ledger is down this waits out the
        timeout. Never raises.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with self._progress:
                while True:
                    self._wake.set()
                    if self._drained():
                        return True
                    if self._shutdown_started and not self._thread.is_alive():
                        return False
                    remaining = 0.05 if deadline is None else min(0.05, deadline - time.monotonic())
                    if remaining <= 0:
                        return False
                    self._progress.wait(remaining)
        except Exception:
            self._log(logging.ERROR, "flush", "chunkledger exporter: force_flush() failed", exc_info=True)
            return False

    def _drained(self) -> bool:
        return not (
            self._in_cycle
            or self._queue
            or self._drops_pending
            or self._held
            or self._ready
            or self._inflight
            or (self._spool is not None and self._spool)
        )

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop accepting events, deliver (or spool) what is queued, stop the worker. Idempotent.

        Returns True when everything was delivered or spooled within ``timeout`` seconds (default
        ``config.shutdown_timeout_s``). Events emitted afterwards are counted as dropped ("shutdown").
        """
        timeout = self.config.shutdown_timeout_s if timeout is None else timeout
        with self._lock:
            first = not self._shutdown_started
            self._shutdown_started = True
            self._closed = True
            self._limit = 0
        if first:
            now = time.monotonic()
            self._stop_deadline = now + max(0.0, timeout)
            self._send_deadline = now + 0.8 * max(0.0, timeout)  # then spool the rest, in time
            self._stop.set()
            self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if self._poll_client is not None:
            with contextlib.suppress(Exception):  # ends a poll held by the ledger
                self._poll_client.close()
        if self._thread.is_alive():
            self._shutdown_ok = False
            self._log(
                logging.WARNING, "shutdown", "chunkledger exporter: shutdown timed out after %.1fs", timeout
            )
        return self._shutdown_ok

    def stats(self) -> ExporterStats:
        """The self-metrics as a snapshot (cheap; safe from any thread)."""
        spool = self._spool
        with self._counts_lock:  # one consistent snapshot of what the worker and the senders count
            sent, duplicates, batches_sent = self._sent, self._duplicates, self._batches_sent
            attempts, failures, retried = self._attempts, self._send_failures, self._retried
            spooled, replayed, last_success_ts = self._spooled, self._replayed, self._last_success_ts
        return ExporterStats(
            source_id=self._source.id,
            queued=len(self._queue) + self._extra,
            numbered=self._next_seq - self._first_seq,
            last_seq=self._next_seq - 1 if self._next_seq > self._first_seq else None,
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
            dropped=dict(self._dropped),
            commands=self._commands,
            last_success_ts=last_success_ts,
        )

    # -- worker -----------------------------------------------------------------------------------

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
        flush = self.config.flush_interval_s
        if not (self._backlog() or self._queue or self._ready):
            return flush
        now = time.monotonic()
        wait = self._down_until - now
        if wait > 0:  # the ledger is backing off: keep (spool) what is queued meanwhile
            return min(flush, wait)
        if self._backlog():
            return flush if inflight else 0.0
        if len(inflight) >= self._max_in_flight:
            return flush
        if self._ready or len(self._queue) + self._extra >= self._batch_size:
            return 0.0
        if inflight:  # a partial batch follows the ones in flight on the flush timer
            return min(flush, max(self._next_partial - now, 0.001))
        return 0.001

    def _guarded_cycle(self, final: bool) -> None:
        with self._progress:
            self._in_cycle = True
        try:
            if final:
                self._final_cycle()
            else:
                self._cycle(time.monotonic() + 0.5)
        except Exception:
            self._log(logging.ERROR, "cycle", "chunkledger exporter: worker error", exc_info=True)
        finally:
            with self._progress:
                self._in_cycle = False
                self._progress.notify_all()

    def _cycle(self, until: float) -> None:
        """Step the worker until it has to wait (for an answer, the backoff or events) or ``until``."""
        self._place_marker()
        while time.monotonic() < until and not self._stop.is_set() and self._step(final=False):
            pass

    def _final_cycle(self) -> None:
        """Shutdown: one attempt per batch until the send deadline, then spool what is left.

        Batches still unanswered at the deadline are given up on: fresh ones go to the spool (the ledger
        may still store them; a later replay is then counted as duplicates), a replayed record stays in
        the spool.
        """
        deadline = self._send_deadline
        with self._lock:
            if self._drops_pending:
                self._queue.append((_MARKER, self._take_drops_locked()))
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
        lost += len(self._queue) + self._extra
        if lost:
            self._queue.clear()
            self._held.clear()
            self._ready.clear()
            self._extra = 0
            self._record_drop("shutdown", lost, report=False)
            self._shutdown_ok = False
            log.error(
                "chunkledger exporter %s: %d events could be neither delivered nor spooled at shutdown",
                self._source.id,
                lost,
            )

    def _report_spooled(self) -> None:
        """Shutdown: say what stays in the spool for the next start of this source."""
        spool = self._spool
        if spool is not None and spool:
            log.warning(
                "chunkledger exporter %s: %d events (%d batches) stay spooled in %s; they are sent when "
                "source %s starts again with this spool folder",
                self._source.id,
                spool.pending_events,
                spool.pending_records,
                spool.directory,
                self._source.id,
            )

    def _close_resources(self) -> None:
        for _ in self._senders:
            self._jobs.put(None)
        with contextlib.suppress(Exception):
            self._client.close()
        if self._spool is not None:
            with contextlib.suppress(Exception):
                self._spool.close()

    def _place_marker(self) -> None:
        """Queue a drop marker the engine thread has not placed yet (e.g. the engine went idle)."""
        if not self._drops_pending:
            return
        with self._lock:
            if self._drops_pending and len(self._queue) + self._extra < self._queue_size:
                self._queue.append((_MARKER, self._take_drops_locked()))
                self._rearm_locked()

    def _rearm_locked(self) -> None:
        if self._closed or self._drops_pending:
            self._limit = 0
        elif len(self._queue) + self._extra >= self._batch_size:
            self._limit = self._queue_size
        else:
            self._limit = self._batch_size

    def _take(self, max_events: int) -> list[tuple[_Layout, Any]]:
        queue = self._queue
        entries = []
        taken = extra = 0
        while queue and taken < max_events:
            entry = queue.popleft()
            entries.append(entry)
            if entry[0].many:
                rows = len(entry[1])
                taken += rows
                extra += rows - 1
            else:
                taken += 1
        with self._lock:
            self._extra -= extra
            self._rearm_locked()
        return entries

    def _prepare(self, entries: Iterable[tuple[_Layout, Any]]) -> list[Prepared]:
        """Number, build and encode events in queue order; cut into batches of ``batch_size``."""
        events: list[Event] = []
        markers: set[int] = set()
        invalid = 0
        seq = self._next_seq
        append = events.append
        for layout, values in entries:
            build = layout.build
            rows = values if layout.many else (values,)
            for row in rows:
                try:
                    append(build(seq, row))
                    seq += 1
                except Exception:
                    invalid += 1
                    self._log(
                        logging.ERROR,
                        f"build:{layout.kind.__name__}",
                        "chunkledger exporter: cannot build a %s event from %r",
                        layout.kind.__name__,
                        row,
                        exc_info=True,
                    )
            if layout is _MARKER:
                markers.update(range(seq - len(rows), seq))
        prepared = self._encode(events, markers)
        if prepared is None:  # something failed the contract's validation: find it, renumber the rest
            good = [ev for ev in events if self._valid(ev)]
            invalid += len(events) - len(good)
            events = [msgspec.structs.replace(ev, seq=self._next_seq + i) for i, ev in enumerate(good)]
            markers = {self._next_seq + i for i, ev in enumerate(events) if isinstance(ev, Dropped)}
            prepared = self._encode(events, markers) or []
        self._next_seq += len(events)
        if invalid:
            self._record_drop("invalid", invalid)
        return prepared

    def _valid(self, event: Event) -> bool:
        try:
            _event_validator.decode(batch_encoder.encode(event))
            return True
        except (msgspec.ValidationError, TypeError, ValueError, OverflowError) as exc:
            self._log(
                logging.ERROR,
                "invalid",
                "chunkledger exporter: invalid %s event: %s",
                type(event).__name__,
                exc,
            )
            return False

    def _encode(self, events: list[Event], markers: set[int]) -> list[Prepared] | None:
        out = []
        for start in range(0, len(events), self._batch_size):
            chunk = events[start : start + self._batch_size]
            try:
                body = batch_encoder.encode(Batch(source=self._source, events=chunk))
            except (TypeError, ValueError, OverflowError):  # a value msgspec cannot encode
                return None
            try:
                _batch_validator.decode(body)
            except msgspec.ValidationError:
                return None
            first, last = chunk[0].seq, chunk[-1].seq
            markers_only = all(s in markers for s in range(first, last + 1)) if markers else False
            out.append(Prepared(body, len(chunk), first, last, markers_only))
        return out

    def _backlog(self) -> bool:
        return bool(self._held) or bool(self._spool)

    def _step(self, final: bool) -> bool:
        """One move of the worker (see the module docstring); False when it has to wait.

        Settles answered batches oldest first, then either replays the backlog (one batch at a time,
        nothing else in flight), keeps fresh batches behind it (spool), or sends the next fresh batch
        when the window has room.
        """
        progressed = self._collect()
        now = time.monotonic()
        gate_closed = now < self._down_until or (final and now >= self._send_deadline)
        if gate_closed or self._backlog():
            inflight = self._inflight
            if not gate_closed and all(j.kind == _SPOOLED for j in inflight):
                # Replay: up to max_in_flight POSTs of merged spool records. Fresh events wait in the
                # queue behind the backlog; past half the queue they are spooled behind it.
                # After a failure one replay probes the ledger; the window opens once it is taken.
                window = 1 if self._failures else self._max_in_flight
                if len(inflight) < window and self._submit_replay():
                    return True
                if (
                    inflight
                    and not self._held  # the spool took the last one: held batches would pile up
                    and len(self._queue) + self._extra >= self._queue_size // 2
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
            if not self._ready and not self._held and self._queue:
                self._fill_ready()
                progressed = True
            if self._ready:
                self._keep(self._ready.popleft())
                return True
            return progressed
        if len(self._inflight) >= self._max_in_flight:
            return progressed
        if not self._ready:
            if not self._queue:
                return progressed
            partial = len(self._queue) + self._extra < self._batch_size
            if self._inflight and partial and now < self._next_partial:
                return progressed  # a partial batch behind others waits for the flush timer
            self._next_partial = now + self.config.flush_interval_s
            self._fill_ready()
            if not self._ready:
                return True  # everything taken was invalid (counted as dropped)
        self._submit(_FRESH, self._ready.popleft(), 1 if final else self.config.max_attempts)
        return True

    def _fill_ready(self) -> None:
        self._ready.extend(self._prepare(self._take(self._batch_size * _TAKE_CHUNKS)))

    def _submit(
        self, kind: int, prepared: Prepared, attempts: int, end: SpoolPos | None = None, records: int = 1
    ) -> None:
        job = _Job(kind, prepared, attempts, end, records)
        self._inflight.append(job)
        self._jobs.put(job)

    def _submit_replay(self) -> bool:
        """Send the next backlog batch: spool records after those in flight, merged up to
        ``replay_max_events``, else (nothing in flight) the oldest held batch. False when none."""
        spool = self._spool
        replaying = any(j.kind == _SPOOLED for j in self._inflight)
        if not replaying:  # the window is empty: read from the head (again, after a failure)
            self._replay_pos, self._replay_broken = None, False
        if spool is not None and spool and not self._replay_broken:
            single = self._replay_single_until is not None
            got = spool.read(
                self._replay_pos,
                max_events=0 if single else self.config.replay_max_events,
                max_bytes=self.config.replay_max_bytes,
            )
            torn_records, torn_events = spool.take_torn()
            if torn_records:
                self._record_drop("spool_torn", torn_events)
            if got.records:
                body, used, events = merge_records(got.records)
                end = got.ends[used - 1] if used < len(got.records) else got.end
                self._replay_pos = end
                until = self._replay_single_until
                if until is not None and end >= until:
                    self._replay_single_until = None
                self._submit(_SPOOLED, Prepared(body, events, -1, -1), 1, end, used)
                return True
            if not replaying and got.end != spool.head():
                spool.release(got.end, 0, 0)  # only torn records were left
        if replaying:
            return False
        if self._held:
            self._submit(_HELD, self._held[0], 1)
            return True
        self._overflow_reason = "queue_full"
        return False

    def _collect(self) -> bool:
        """Settle the answered batches at the head of the window, in the order they were sent."""
        inflight = self._inflight
        settled = False
        while inflight and inflight[0].done:
            self._settle(inflight.popleft())
            settled = True
        return settled

    def _settle(self, job: _Job) -> None:
        """Worker: act on a batch's outcome (its counters and commands were done by its sender)."""
        outcome = job.outcome
        if isinstance(outcome, float):  # not taken: a fresh batch joins the backlog, a replayed one stays
            if job.kind == _FRESH:
                if time.monotonic() >= self._down_until:  # one backoff step per outage, not per batch
                    self._enter_down(None)
                self._keep(job.prepared)
            else:
                if job.kind == _SPOOLED:
                    self._replay_broken = True  # its records stay; the ones after it are sent again
                self._enter_down(outcome)
            return
        if outcome == _ACKED:
            self._failures = 0
            self._down_until = 0.0
        if job.kind == _SPOOLED:
            assert self._spool is not None and job.end is not None
            if outcome == _SPLIT:
                self._replay_broken = True
                self._replay_single_until = job.end
            elif not self._replay_broken:  # settled oldest first: everything before it is released
                self._spool.release(job.end, job.records, job.prepared.events)
        elif job.kind == _HELD:
            self._held.popleft()

    def _abandon_in_flight(self) -> None:
        """Shutdown's send deadline passed: stop waiting; spool the fresh batches still unanswered."""
        while self._inflight:
            job = self._inflight.popleft()
            with self._counts_lock:
                job.abandoned = job.outcome is None  # its sender ignores the answer from now on
            if not job.abandoned:
                self._settle(job)
            elif job.kind == _FRESH:
                self._keep(job.prepared)

    def _keep(self, prepared: Prepared) -> None:
        """Append to the spool; hold in memory when it is full or off (the queue then fills up)."""
        if not self._held and self._spool is not None:
            try:
                if self._spool.append(prepared.body, prepared.events):
                    with self._counts_lock:
                        self._spooled += prepared.events
                    return
                self._log(logging.WARNING, "spool_full", "chunkledger exporter: the spool is full")
            except OSError as exc:
                self._log(
                    logging.ERROR, "spool_write", "chunkledger exporter: cannot write the spool: %s", exc
                )
        self._held.append(prepared)
        self._overflow_reason = "spool_full" if self._spool is not None else "queue_full"

    # -- sender threads ---------------------------------------------------------------------------

    def _send_loop(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        while (job := jobs.get()) is not None:
            self._send(job)

    def _send(self, job: _Job) -> None:
        """Sender thread: POST a batch (a fresh one with retries), record the outcome, wake the worker."""
        outcome: str | float = 0.0
        try:
            for attempt in range(job.attempts):
                outcome = self._post(job)
                if not isinstance(outcome, float) or attempt + 1 == job.attempts:
                    break
                with self._counts_lock:
                    self._retried += 1
                if self._stop.wait(self._backoff(attempt, outcome)):
                    break  # shutting down: the worker spools it
        except Exception:
            self._log(logging.ERROR, "send", "chunkledger exporter: sender error", exc_info=True)
        finally:
            with self._counts_lock:
                if job.outcome is None:
                    job.outcome = outcome
            job.done = True
            self._wake.set()

    def _post(self, job: _Job) -> str | float:
        """POST one batch: _ACKED, _REJECTED (dropped) or, when it failed, a retry hint in seconds."""
        prepared = job.prepared
        with self._counts_lock:
            self._attempts += 1
        try:
            response = self._client.post(self.config.events_url, content=prepared.body)
        except httpx.HTTPError as exc:
            with self._counts_lock:
                self._send_failures += 1
            self._log(
                logging.WARNING,
                f"send:{type(exc).__name__}",
                "chunkledger exporter: ledger at %s unreachable (%s: %s); retrying, then spooling",
                self.config.url,
                type(exc).__name__,
                exc,
            )
            return 0.0
        status = response.status_code
        if 200 <= status < 300:
            self._acknowledged(job, response.content)
            return _ACKED
        with self._counts_lock:
            self._send_failures += 1
        if status >= 500 or status in _RETRY_STATUSES:
            self._log(
                logging.ERROR if status in (401, 403, 404) else logging.WARNING,
                f"status:{status}",
                "chunkledger exporter: ledger answered HTTP %d (%s); retrying, then spooling",
                status,
                response.text[:200],
            )
            return _retry_after(response) or 0.0
        if job.records > 1:  # merged spool records: find the one it refuses, drop only that
            self._log(
                logging.WARNING,
                f"split:{status}",
                "chunkledger exporter: ledger refused a merged replay with HTTP %d (%s); sending its "
                "%d batches one by one",
                status,
                response.text[:200],
                job.records,
            )
            with self._counts_lock:
                if not job.abandoned:
                    job.outcome = _SPLIT
            return _SPLIT
        self._log(
            logging.ERROR,
            f"rejected:{status}",
            "chunkledger exporter: ledger rejected a batch with HTTP %d (%s); dropping it",
            status,
            response.text[:200],
        )
        with self._counts_lock:
            if job.abandoned:
                return _REJECTED
            job.outcome = _REJECTED
            if job.kind != _FRESH:
                self._replayed += prepared.events
        self._record_drop("rejected", prepared.events, report=not prepared.markers_only)
        return _REJECTED

    def _acknowledged(self, job: _Job, content: bytes) -> None:
        """Sender thread: count an acknowledged batch and hand its commands over (before it is done)."""
        try:
            answer = response_decoder.decode(content)
        except msgspec.DecodeError as exc:
            self._log(logging.WARNING, "answer", "chunkledger exporter: unreadable ingest answer: %s", exc)
            answer = None
        events = job.prepared.events
        with self._counts_lock:
            if job.abandoned:  # shutdown spooled it meanwhile: a replay will be counted as duplicates
                return
            job.outcome = _ACKED
            self._sent += events
            self._batches_sent += 1
            if job.kind != _FRESH:
                self._replayed += events
            if answer is not None:
                self._duplicates += answer.duplicates
            self._last_success_ts = time.time()
        for command in answer.commands if answer is not None else ():
            self._hand_over(command)

    def _hand_over(self, command: Command) -> None:
        """Worker or poller thread: give the host a command once per command id."""
        if self._on_command is None:
            return
        with self._command_lock:
            if command.id in self._commands_seen:
                return
            try:
                self._on_command(command)
            except Exception:
                self._log(
                    logging.ERROR,
                    "on_command",
                    "chunkledger exporter: on_command callback failed",
                    exc_info=True,
                )
                return  # not remembered: the ledger re-sends it until it is confirmed
            self._commands += 1
            self._commands_seen[command.id] = None
            if len(self._commands_seen) > _COMMAND_MEMORY:
                self._commands_seen.popitem(last=False)

    def _backoff(self, attempt: int, hint: float | None) -> float:
        """Exponential backoff with equal jitter: half the delay fixed, half random."""
        delay = min(self.config.backoff_max_s, self.config.backoff_initial_s * (2**attempt))
        delay = delay / 2 + random.uniform(0, delay / 2)
        return min(self.config.backoff_max_s, max(delay, hint or 0.0))

    def _enter_down(self, hint: float | None) -> None:
        """The ledger did not take a batch: try again only after a growing, jittered delay."""
        self._down_until = time.monotonic() + self._backoff(self._failures, hint)
        self._failures = min(self._failures + 1, 30)

    # -- process life cycle -----------------------------------------------------------------------

    def _after_fork_in_child(self) -> None:
        """The child of a fork becomes a new source ``<id>-<pid>`` with its own queue, worker and spool.

        The parent keeps sending what it had queued; the child must neither re-send it nor share the
        parent's sequence numbers, HTTP connection or spool folder.
        """
        was_closed = self._closed
        self._queue.clear()  # the same deque object: emitters hold a reference to it
        self._source = Source(
            id=f"{self.config.source_id[:100]}-{os.getpid()}",
            kind=self._source.kind,
            model=self._source.model,
        )
        self.config = msgspec.structs.replace(self.config, source_id=self._source.id, seq_start=None)
        self._log = _LogOnce()
        self._init_state()
        if was_closed:
            self._closed = self._shutdown_started = True
            self._limit = 0
            self._spool = None
            return
        try:
            self._spool = self._open_spool()
        except SpoolError as exc:
            self._spool = None
            log.error("chunkledger exporter: no spool after fork: %s", exc)
        self._start_worker()


_KEYWORD_LAYOUTS: dict[type[Any], _Layout] = {}


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


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
