"""Ingest: a checked batch (``ledger/validation.py``, ``ledger/columnar.py``) stored through a
group-committing writer thread.

The writer owns the store's write path. Request handlers hand it decoded batches and wait; it takes
whatever has queued up (up to ``max_group_events``), stores it in one transaction and only then
answers each handler. Under load this turns many small commits into few large ones; with one client
it adds nothing but a thread hop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_hooks import events as ev
from ledger.columnar import Columns
from ledger.store import Store, WriteResult

log = logging.getLogger(__name__)


class WriterUnavailable(RuntimeError):
    """The store could not take the batch (database down, writer stopped); the client should retry."""


# A queued batch: the batch, its producer digest, the future its handler waits on, its size in bytes,
# and its columns when it came as a columnar message.
_Item = tuple[ev.Batch, str | None, concurrent.futures.Future[WriteResult], int, Columns | None]


@dataclass
class _Slicing:
    """A queued batch, stored in one group or, when large, in slices over several."""

    item: _Item
    taken: int = 0  # events put into groups so far
    stored: int = 0  # events of groups that committed
    failed: bool = False  # a group with a slice of it failed: answered 503, the rest not stored
    accepted: int = 0
    duplicates: int = 0
    conflicts: list[int] = field(default_factory=list)
    foreign: set[str] = field(default_factory=set)


@dataclass
class _Piece:
    """Events ``start:end`` of a queued batch, in one group."""

    job: _Slicing
    start: int
    end: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.end == len(self.job.item[0].events)

    def batch(self) -> ev.Batch:
        b = self.job.item[0]
        if self.whole:
            return b
        return ev.Batch(source=b.source, events=b.events[self.start : self.end])

    def columns(self) -> Columns | None:
        """The columns of its batch when it is the whole of it (a slice folds from its events)."""
        return self.job.item[4] if self.whole else None


class IngestWriter:
    """A thread that owns the store's write path and commits queued batches in groups."""

    def __init__(
        self,
        store: Store,
        *,
        max_group_events: int = 50_000,
        slice_events: int = 1024,
        slice_bytes: int = 512 * 1024,
        on_commit: Callable[[ev.Batch, int, int], None] | None = None,
        on_group: Callable[[float, int], None] | None = None,
        slow_group_s: float = 1.0,
    ) -> None:
        self.store = store
        self.max_group_events = max_group_events
        # A source puts at most this many events, and about this many bytes, into one group.
        self.slice_events = slice_events
        self.slice_bytes = slice_bytes
        # Called on this thread after each commit, per batch, with (batch, accepted, duplicates), before
        # the batch's handler is answered (the rule engine: its commands can ride on that answer).
        self.on_commit = on_commit
        self.on_group = on_group  # called with (seconds, events) after each group commit
        self.slow_group_s = slow_group_s  # a group taking longer is logged with its phases
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="chunkledger-writer", daemon=True)
        self._stopping = False
        self.groups_committed = 0
        self.batches_committed = 0
        # Why the latest write failed, until one succeeds (``/readyz`` is not ready meanwhile: a ledger
        # whose disk is full answers every batch 503 and must not say it is ready).
        self.failing: str | None = None

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def submit(
        self, batch: ev.Batch, producer: str | None = None, nbytes: int = 0, columns: Columns | None = None
    ) -> WriteResult:
        """Store ``batch`` (``producer``: the digest of the producer key it came with, or None;
        ``nbytes``: the size of its body, which bounds the slices of a large batch; ``columns``: the
        message it was decoded from, whose step columns the store folds as they are)."""
        if not self.alive:
            raise WriterUnavailable("the ledger is shutting down")
        fut: concurrent.futures.Future[WriteResult] = concurrent.futures.Future()
        self._queue.put((batch, producer, fut, nbytes, columns))
        return await asyncio.wrap_future(fut)

    def stop(self, timeout: float = 30.0) -> None:
        """Store everything already queued, then stop. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        log.info(
            "writer stopped: %d batches in %d group commits", self.batches_committed, self.groups_committed
        )

    def _run(self) -> None:
        """Store what has queued up in groups, one transaction each; every source takes at most
        ``slice_events`` events into a group, in arrival order.

        So a source sending huge batches gets a slice of each group and the small batches of the other
        sources are not held behind all of it (a 16 MB batch used to hold every other source's answer
        for its whole commit), while a group still commits once for all sources. A batch is answered
        when its last slice is in; one cut short by a failure is answered 503, and its retry stores
        only what the slices did not (events are deduplicated by (source, seq))."""
        stop = False
        # Per source, its queued batches in arrival order (a later one first would leave the earlier
        # one's events below the high-water mark, each slice then probing ``events``).
        pending: collections.OrderedDict[str, collections.deque[_Slicing]] = collections.OrderedDict()
        while not (stop and not pending):
            items: list[_Item | None] = []
            if pending or stop:  # work to do: take what waits, do not wait
                if not stop:
                    with contextlib.suppress(queue.Empty):
                        items.append(self._queue.get_nowait())
            else:
                try:
                    items.append(self._queue.get(timeout=1.0))
                except queue.Empty:  # idle: compact what the last groups left
                    self._compact()
                    continue
            while items:
                item = items.pop()
                if item is None:
                    stop = True
                    break
                pending.setdefault(item[0].source.id, collections.deque()).append(_Slicing(item))
                with contextlib.suppress(queue.Empty):
                    items.append(self._queue.get_nowait())
            if pending:
                self._write_group(self._take(pending))
                self._settle(pending)
            self._compact()

    def _take(self, pending: collections.OrderedDict[str, collections.deque[_Slicing]]) -> list[_Piece]:
        """The next group: from each source in turn, its next events up to ``slice_events`` (whole
        batches that fit, or a slice of a larger one), until the group holds ``max_group_events``.
        The sources served go last, so the next group starts with any left out."""
        pieces: list[_Piece] = []
        total = 0
        for sid in list(pending):
            if total >= self.max_group_events:
                break
            budget = self.slice_events
            for job in pending[sid]:
                events = job.item[0].events
                left = len(events) - job.taken
                if left > budget and budget < self.slice_events:
                    break  # does not fit beside what the source has in this group: the next one
                # at most ``slice_events`` events and about ``slice_bytes`` of the body
                by_size = self.slice_bytes * len(events) // job.item[3] if job.item[3] else left
                n = max(1, min(left, budget, by_size)) if left > 0 else 0  # an empty batch: one empty piece
                pieces.append(_Piece(job, job.taken, job.taken + n))
                job.taken += n
                budget -= n
                total += n
                if job.taken < len(job.item[0].events) or budget <= 0:
                    break
            pending.move_to_end(sid)
        return pieces

    @staticmethod
    def _settle(pending: collections.OrderedDict[str, collections.deque[_Slicing]]) -> None:
        """Forget the batches that were answered (stored in full, or failed)."""
        for sid in list(pending):
            jobs = pending[sid]
            while jobs and (jobs[0].failed or jobs[0].stored == len(jobs[0].item[0].events)):
                jobs.popleft()
            if not jobs:
                del pending[sid]

    def _compact(self) -> None:
        """Let the store merge partial rows when due: between groups, after their batches were answered."""
        try:
            self.store.compact()
        except Exception:  # the parts stay readable through the view; the next call retries
            log.exception("compacting partial request rows failed")

    def _write_group(self, pieces: list[_Piece]) -> None:
        t0 = time.perf_counter()
        batches = [p.batch() for p in pieces]
        try:
            results = self.store.write(
                batches, [p.job.item[1] for p in pieces], [p.columns() for p in pieces]
            )
        except Exception as exc:
            if len(pieces) > 1:
                # Do not let one batch fail its neighbours: store them one by one.
                for piece in pieces:
                    if not piece.job.failed:
                        self._write_group([piece])
                return
            job = pieces[0].job
            log.warning("storing a batch from %s failed: %s", job.item[0].source.id, exc)
            self.failing = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            job.failed = True
            job.item[2].set_exception(WriterUnavailable(f"storage failed: {type(exc).__name__}: {exc}"))
            return
        took = time.perf_counter() - t0
        self.failing = None
        self.groups_committed += 1
        n_events = sum(len(b.events) for b in batches)
        if took > self.slow_group_s:
            phases = ", ".join(f"{k} {v:.3f}" for k, v in self.store.last_write_phases.items())
            log.warning(
                "slow group commit: %.2f s for %d events in %d batches (%s)",
                took,
                n_events,
                len(batches),
                phases,
            )
        if self.on_group is not None:
            self.on_group(took, n_events)
        for piece, res in zip(pieces, results, strict=True):
            job = piece.job
            job.accepted += res.accepted
            job.duplicates += res.duplicates
            job.conflicts += res.conflicts
            job.foreign.update(res.foreign)
            job.stored = piece.end
            if job.stored < len(job.item[0].events) or job.failed:
                continue
            batch, _, fut, _, _ = job.item
            self.batches_committed += 1
            if self.on_commit is not None:
                try:
                    self.on_commit(batch, job.accepted, job.duplicates)
                except Exception:  # stored is stored: a hook failure must not fail the batch
                    log.exception("post-commit hook failed for a batch from %s", batch.source.id)
            fut.set_result(WriteResult(job.accepted, job.duplicates, job.conflicts, sorted(job.foreign)))
