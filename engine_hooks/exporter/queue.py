"""The engine-side half of the exporter: the bounded event queue and the emit fast path.

The hot path is a closure that appends ``(layout, values)`` to a deque after one length check: no
Struct is built, nothing is encoded and no lock is taken on the engine thread. ``emitter(...).many(rows)``
hands a whole step's rows in one call, which costs about as much as the host appending those rows to
a list of its own. Everything past the length check (waking the worker at a full batch, counting drops,
placing the drop marker) is the slow path, ``_admit``, under ``_lock``.

Drops happen here when the queue is full (the worker cannot keep up, or it is holding back because the
ledger is down and the spool is full or disabled) and after shutdown; the worker reports the others
(``record_drop``). Each is counted by reason, and the next batch carries a ``dropped`` marker event
(one per reason, each with a seq of its own) so the ledger shows the hole.

The worker sees the queue only as a ``WorkerQueue``: it takes entries, places markers, records drops
and says what an overflow counts as. The exporter that owns the queue also closes it, reads its drop
counts and restarts it in a forked child.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, cast

import msgspec

from engine_hooks.events import Dropped, Event
from engine_hooks.exporter.logonce import LogOnce


class Layout(NamedTuple):
    """How the values of a queue entry become events."""

    kind: type[Any]
    fields: tuple[str, ...]
    build: Callable[[int, Any], Event]  # (seq, values) -> event
    many: bool  # values is a sequence of rows, not one row


class Emitter(Protocol):
    """A fast emit function for one event kind and a fixed field order (see ``Exporter.emitter``)."""

    kind: type[Any]
    fields: tuple[str, ...]

    def __call__(self, *values: Any) -> None: ...

    def many(self, rows: Sequence[Sequence[Any]]) -> None: ...


def make_builder(kind: type[Any], fields: tuple[str, ...]) -> Callable[[int, Any], Event]:
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


MARKER = Layout(Dropped, ("ts", "reason", "count", "first_ts"), _build_marker, True)
_KEYWORD_LAYOUTS: dict[type[Any], Layout] = {}


class WorkerQueue(Protocol):
    """What the worker (``batcher.py``) does with the queue; ``EventQueue`` is the implementation."""

    def pending(self) -> int:
        """Events waiting to be taken (a many-entry counts its rows)."""
        ...

    def marker_due(self) -> bool:
        """Drops were counted that no marker in the queue reports yet."""
        ...

    def take(self, max_events: int) -> list[tuple[Layout, Any]]:
        """Remove and return the oldest entries, up to about ``max_events`` events."""
        ...

    def place_marker(self, force: bool = False) -> None:
        """Queue the drop marker that is due, if any and if there is room (else the next emit does)."""
        ...

    def record_drop(self, reason: str, n: int, report: bool = True) -> None:
        """Count ``n`` events lost past the queue; ``report``: a marker tells the ledger."""
        ...

    def count_overflow_as(self, reason: str) -> None:
        """The reason an emit on a full queue is dropped under ("queue_full", "spool_full")."""
        ...

    def discard(self) -> int:
        """Empty the queue; the events it held."""
        ...


class EventQueue:
    """A bounded FIFO of ``(layout, values)`` entries that never blocks and never raises on emit.

    ``_extra`` counts the events of ``many`` entries beyond one per entry, so ``len(_queue) + _extra``
    is the number of events queued. ``_limit`` is the fast path's threshold: below it an emit only
    appends; at it (a full batch, a full queue, a drop marker to place, shutdown) emit takes ``_admit``.
    The worker takes entries from the other end (``take``). ``wake`` is set at a full batch; ``log``
    reports a failed emit.
    """

    def __init__(self, queue_size: int, batch_size: int, wake: threading.Event, log: LogOnce):
        self._queue: deque[tuple[Layout, Any]] = deque()  # emitters hold it: never replaced
        self._queue_size = queue_size
        self._batch_size = batch_size
        self._closed = False
        self._reset(wake, log)

    def _reset(self, wake: threading.Event, log: LogOnce) -> None:
        """The state a forked child starts afresh (the deque and ``_closed`` stay)."""
        self._lock = threading.Lock()  # guards _extra, _limit, drops; the fast path takes no lock
        self._extra = 0  # events in queued many-entries beyond one per entry
        self._limit = 0 if self._closed else self._batch_size  # at it, emit takes the slow path
        self._overflow_reason = "queue_full"  # drop reason while the queue is full; "spool_full" when the
        # worker holds batches back because the spool is full
        self._drops_pending: dict[str, list[float]] = {}  # reason -> [count, first_ts]
        self._dropped: dict[str, int] = {}
        self._wake = wake  # wakes the worker (a full batch)
        self._log = log

    # -- the engine thread ------------------------------------------------------------------------

    def emitter(self, kind: type[Any], *fields: str) -> Emitter:
        """A fast emit function for ``kind`` taking ``fields`` positionally (``Exporter.emitter``).

        The function appends to the deque after one length check (see the module docstring).
        Raises ValueError here (at setup) for unknown or missing fields; emitting never raises.
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
        build = make_builder(kind, names)
        one, many = Layout(kind, names, build, False), Layout(kind, names, build, True)
        queue, append, admit, clock = self._queue, self._queue.append, self._admit, time.time

        if stamp:

            def emit(*values: Any) -> None:
                values = (clock(), *values)
                if len(queue) + self._extra < self._limit:
                    append((one, values))
                else:
                    admit(one, values, 1)

            def emit_many(rows: Sequence[Sequence[Any]]) -> None:
                try:
                    now = clock()
                    admit(many, [(now, *row) for row in rows], len(rows))
                except Exception:
                    self._log(
                        logging.ERROR, "many", "chunkledger exporter: bad rows for %s", kind, exc_info=True
                    )

        else:

            def emit(*values: Any) -> None:
                if len(queue) + self._extra < self._limit:
                    append((one, values))
                else:
                    admit(one, values, 1)

            def emit_many(rows: Sequence[Sequence[Any]]) -> None:
                try:
                    admit(many, rows, len(rows))
                except Exception:
                    self._log(
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
                layout = _KEYWORD_LAYOUTS.setdefault(kind, Layout(kind, (), _build_keywords(kind), False))
            if len(self._queue) + self._extra < self._limit:
                self._queue.append((layout, fields))
            else:
                self._admit(layout, fields, 1)
        except Exception:
            self._log(logging.ERROR, "emit", "chunkledger exporter: emit() failed", exc_info=True)

    def _admit(self, layout: Layout, values: Any, n: int) -> None:
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
                    queue.append((MARKER, self._take_drops_locked()))
                queue.append((layout, values))
                self._extra += n - 1
                if occupancy + n >= self._batch_size:
                    self._limit = self._queue_size
                    self._wake.set()
                else:
                    self._limit = self._batch_size
        except Exception:
            self._log(logging.ERROR, "admit", "chunkledger exporter: emit() failed", exc_info=True)

    # -- drops ------------------------------------------------------------------------------------

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

    def record_drop(self, reason: str, n: int, report: bool = True) -> None:
        """A drop found past the queue (worker, senders, encoder): counted now; unless ``report`` is
        False, a marker is placed by the next emit or the worker's next cycle."""
        if n <= 0:
            return
        with self._lock:
            self._count_drop_locked(reason, n, time.time(), report)
        self._log(
            logging.WARNING, f"drop:{reason}", "chunkledger exporter: dropped %d events (%s)", n, reason
        )

    def dropped(self) -> dict[str, int]:
        """Events dropped so far, by reason (a copy)."""
        return dict(self._dropped)

    # -- the worker's side (WorkerQueue) ----------------------------------------------------------

    def pending(self) -> int:
        """Events waiting to be taken (a many-entry counts its rows)."""
        return len(self._queue) + self._extra

    def marker_due(self) -> bool:
        """Drops were counted that no marker in the queue reports yet."""
        return bool(self._drops_pending)

    def place_marker(self, force: bool = False) -> None:
        """Queue a drop marker the engine thread has not placed yet (e.g. the engine went idle).

        ``force`` (shutdown's last cycle): even past the queue's size, and the fast path stays closed.
        """
        if not self._drops_pending:
            return
        with self._lock:
            if self._drops_pending and (force or len(self._queue) + self._extra < self._queue_size):
                self._queue.append((MARKER, self._take_drops_locked()))
                if not force:
                    self._rearm_locked()

    def _rearm_locked(self) -> None:
        if self._closed or self._drops_pending:
            self._limit = 0
        elif len(self._queue) + self._extra >= self._batch_size:
            self._limit = self._queue_size
        else:
            self._limit = self._batch_size

    def take(self, max_events: int) -> list[tuple[Layout, Any]]:
        """Remove and return the oldest entries, up to about ``max_events`` events (a many-entry is
        whole)."""
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

    def count_overflow_as(self, reason: str) -> None:
        """What a drop on a full queue is counted as ("spool_full" while the worker holds batches back
        because the spool is full, else "queue_full")."""
        self._overflow_reason = reason

    def discard(self) -> int:
        """Shutdown, when nothing more can be sent or spooled: empty the queue; the events it held."""
        lost = len(self._queue) + self._extra
        self._queue.clear()
        self._extra = 0
        return lost

    # -- the owner's side -------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> bool:
        """Shutdown: later emits are counted as dropped ("shutdown"). False when it was closed already."""
        with self._lock:
            first = not self._closed
            self._closed = True
            self._limit = 0
        return first

    def restart(self, wake: threading.Event, log: LogOnce) -> None:
        """In a forked child: empty the queue and start its counts afresh (a closed queue stays closed).

        The deque and this object stay: the emitters hold them.
        """
        self._queue.clear()
        self._reset(wake, log)
