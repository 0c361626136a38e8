"""Ingest: validate a batch body, then store it through a group-committing writer thread.

Validation is all-or-nothing: one bad event rejects the whole batch with an error that names the
event's index, the field and the reason, and nothing of that batch is stored.

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
import operator
import queue
import re
import threading
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine_hooks import events as ev
from ledger.store import Store, WriteResult

log = logging.getLogger(__name__)

_ERR_AT = re.compile(r"^(?P<reason>.*) - at `\$(?P<path>[^`]*)`$", re.S)
_PATH_PART = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_MISSING = re.compile(r"missing required field `([^`]+)`")


@dataclass
class FieldError:
    index: int | None  # event index in the batch, None for batch-level fields
    field: str  # field name, dotted for nested values ("source.kind", "request_ids[3]")
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "field": self.field, "reason": self.reason}


class BadBatch(ValueError):
    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("; ".join(f"event {e.index} field {e.field}: {e.reason}" for e in errors))
        self.errors = errors


def _from_validation_error(exc: msgspec.ValidationError) -> FieldError:
    msg = str(exc)
    m = _ERR_AT.match(msg)
    if m is None:
        return FieldError(None, "", msg)
    reason, path = m["reason"], m["path"]
    parts: list[str | int] = [
        p.group(1) if p.group(1) is not None else int(p.group(2)) for p in _PATH_PART.finditer(path)
    ]
    missing = _MISSING.search(reason)
    if missing:
        parts.append(missing.group(1))
    index: int | None = None
    if len(parts) >= 2 and parts[0] == "events" and isinstance(parts[1], int):
        index = parts[1]
        parts = parts[2:]
    field = ""
    for p in parts:
        field += f"[{p}]" if isinstance(p, int) else (f".{p}" if field else p)
    return FieldError(index, field or ("events" if index is None else "event"), reason)


def decode_batch(body: bytes, *, max_events: int) -> ev.Batch:
    """Decode and check a ``POST /v1/events`` body; raise ``BadBatch`` naming what is wrong."""
    try:
        batch = ev.batch_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadBatch([_from_validation_error(exc)]) from None
    except msgspec.DecodeError as exc:
        raise BadBatch([FieldError(None, "body", f"malformed JSON: {exc}")]) from None
    except RecursionError:
        # msgspec recurses per nesting level, also through unknown fields it skips
        raise BadBatch([FieldError(None, "body", "JSON nested deeper than the decoder allows")]) from None
    errors: list[FieldError] = []
    # One memchr for a backslash first: most bodies have none, and a two-byte search costs 20x more.
    escapes = b"\\" in body
    if escapes and b"\\u0000" in body:  # JSON can carry NUL only escaped; PostgreSQL text cannot store it
        errors += _nul_fields(msgspec.json.decode(body))
    if batch.schema_version > ev.SCHEMA_VERSION:
        errors.append(
            FieldError(None, "schema_version", f"{batch.schema_version} is newer than {ev.SCHEMA_VERSION}")
        )
    if len(batch.events) > max_events:
        errors.append(
            FieldError(None, "events", f"{len(batch.events)} events, at most {max_events} per batch")
        )
    allowed = ev.ENGINE_KINDS if batch.source.kind == "engine" else ev.GATEWAY_KINDS
    # Request ids are checked for '/' and NFC only when the events' text could hold such an id (a '/',
    # or text outside ASCII): single-byte scans, so a batch without either costs nothing per event.
    unicode = not body.isascii() or (escapes and b"\\u" in body)
    check_ids = unicode or body.find(b"/", max(0, body.find(b'"events"'))) >= 0
    prev = -1
    step = ev.Step
    for i, e in enumerate(batch.events):
        if e.seq <= prev:
            errors.append(FieldError(i, "seq", f"must increase within a batch: {e.seq} after {prev}"))
        prev = e.seq
        kind = e.__struct_config__.tag
        if kind not in allowed and kind not in ("dropped", "cutoff_applied"):
            errors.append(FieldError(i, "kind", f"a {batch.source.kind} source cannot send {kind!r} events"))
        if type(e) is step:
            errors += _step_errors(i, e)
            if check_ids:
                errors += _id_errors(i, "request_ids", e.request_ids, unicode)
                errors += _id_errors(i, "stalled_request_ids", e.stalled_request_ids, unicode)
        elif (check_ids and kind != "dropped") or kind in _STARTS:
            rid = e.request_id  # type: ignore[union-attr]
            if "/" in rid or rid in _DOT_SEGMENTS or (unicode and not _nfc(rid)):
                errors.append(FieldError(i, "request_id", _bad_id(rid)))
        if len(errors) >= 20:
            break
    if errors:
        raise BadBatch(errors)
    return batch


_DOT_SEGMENTS = frozenset({".", ".."})
# The events that start a request's row (engine, gateway): its id is checked there whatever the body
# holds (a dot segment cannot be told from the body's numbers by a scan).
_STARTS = frozenset({"queued", "arrived"})


def _nfc(rid: str) -> bool:
    return rid.isascii() or unicodedata.is_normalized("NFC", rid)


def _bad_id(rid: str) -> str:
    """Why a request id cannot be one: it is read back as a path segment (``/v1/requests/{id}``), and
    one id must be one row."""
    if "/" in rid:
        return f"{rid[:300]!r} holds '/': a request id is one path segment of /v1/requests/{{id}}"
    if rid in _DOT_SEGMENTS:
        return f"{rid!r} is a path's dot segment: it cannot be read back at /v1/requests/{{id}}"
    return f"{rid[:300]!r} is not in Unicode NFC form: send it normalised (NFC), so one id is one row"


def _id_errors(i: int, name: str, ids: list[str], unicode: bool) -> list[FieldError]:
    """The request ids a step names must be ids (checked with one join: a step names hundreds)."""
    if not ids:
        return []
    joined = "\x00".join(ids)
    if "/" not in joined and "." not in joined and not (unicode and not joined.isascii()):
        return []
    return [
        FieldError(i, f"{name}[{j}]", _bad_id(r))
        for j, r in enumerate(ids)
        if "/" in r or r in _DOT_SEGMENTS or (unicode and not _nfc(r))
    ][:5]


def _step_errors(i: int, e: ev.Step) -> list[FieldError]:
    """A step's parallel lists must line up: one entry per request they describe (or none)."""
    errors = []
    if e.stalled_kv_blocks and len(e.stalled_kv_blocks) != len(e.stalled_request_ids):
        errors.append(
            FieldError(
                i,
                "stalled_kv_blocks",
                f"{len(e.stalled_kv_blocks)} block counts for {len(e.stalled_request_ids)} stalled "
                "requests: one per stalled request, in the same order (or none)",
            )
        )
    counts, totals, ids, n = e.token_counts, e.token_totals, e.token_ids, len(e.request_ids)
    if not (counts or totals or ids):
        return errors
    if len(counts) != n:
        errors.append(
            FieldError(i, "token_counts", f"{len(counts)} counts for {n} requests: one per request_ids entry")
        )
    if len(totals) != len(counts):
        errors.append(
            FieldError(
                i,
                "token_totals",
                f"{len(totals)} totals for {len(counts)} counts: one per request_ids entry",
            )
        )
    elif any(map(operator.lt, totals, counts)):  # one pass in C; the index only for the error
        j, c, t = next((j, c, t) for j, (c, t) in enumerate(zip(counts, totals, strict=True)) if t < c)
        errors.append(FieldError(i, f"token_totals[{j}]", f"{t} is less than this step's {c} new tokens"))
    if ids and len(ids) != sum(counts):
        errors.append(
            FieldError(
                i,
                "token_ids",
                f"{len(ids)} ids for {sum(counts)} new tokens: the new ids of every request in order "
                "(or none)",
            )
        )
    return errors


def clamp_future(batch: ev.Batch, now: float, max_ahead_s: float) -> int:
    """Set every timestamp more than ``max_ahead_s`` ahead of ``now`` (the receive time) to ``now``.

    An event cannot have happened after the ledger received it; one stamped far ahead comes from a
    source clock that is wrong (or from a hostile source). Stored as sent it would end analytics
    windows in the future and break the per-source step intervals. Returns how many events changed.
    (One pass over a 4,000-event batch: about 0.4 ms, under 1 % of storing it.)
    """
    limit = now + max_ahead_s
    events = batch.events
    changed = 0
    for i, e in enumerate(events):
        k = type(e)
        second = "first_ts" if k is _TOKENS or k is _DROPPED else ("arrival_ts" if k is _QUEUED else None)
        t2 = getattr(e, second) if second is not None else None
        if e.ts <= limit and (t2 is None or t2 <= limit):
            continue
        fix = {"ts": now} if e.ts > limit else {}
        if second is not None and t2 is not None and t2 > limit:
            fix[second] = now
        events[i] = msgspec.structs.replace(e, **fix)
        changed += 1
    return changed


_TOKENS, _DROPPED, _QUEUED = ev.Tokens, ev.Dropped, ev.Queued


def _nul_fields(raw: Any) -> list[FieldError]:
    """The fields of a decoded batch whose text holds a NUL character (at most 20)."""
    found: list[FieldError] = []

    def walk(value: Any, index: int | None, path: str) -> None:
        if len(found) >= 20:
            return
        if isinstance(value, str):
            if "\x00" in value:
                found.append(FieldError(index, path, "text must not contain NUL (\\u0000)"))
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, index, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, index, f"{path}[{i}]")

    if isinstance(raw, dict):
        for key, value in raw.items():
            if key == "events" and isinstance(value, list):
                for i, event in enumerate(value):
                    walk(event, i, "")
            else:
                walk(value, None, key)
    return found


class WriterUnavailable(RuntimeError):
    """The store could not take the batch (database down, writer stopped); the client should retry."""


# A queued batch: the batch, its producer digest, the future its handler waits on, its size in bytes.
_Item = tuple[ev.Batch, str | None, concurrent.futures.Future[WriteResult], int]  # and its body's bytes


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

    def batch(self) -> ev.Batch:
        b = self.job.item[0]
        if self.start == 0 and self.end == len(b.events):
            return b
        return ev.Batch(source=b.source, events=b.events[self.start : self.end])


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

    async def submit(self, batch: ev.Batch, producer: str | None = None, nbytes: int = 0) -> WriteResult:
        """Store ``batch`` (``producer``: the digest of the producer key it came with, or None;
        ``nbytes``: the size of its body, which bounds the slices of a large batch)."""
        if not self.alive:
            raise WriterUnavailable("the ledger is shutting down")
        fut: concurrent.futures.Future[WriteResult] = concurrent.futures.Future()
        self._queue.put((batch, producer, fut, nbytes))
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
            results = self.store.write(batches, [p.job.item[1] for p in pieces])
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
            batch, _, fut, _ = job.item
            self.batches_committed += 1
            if self.on_commit is not None:
                try:
                    self.on_commit(batch, job.accepted, job.duplicates)
                except Exception:  # stored is stored: a hook failure must not fail the batch
                    log.exception("post-commit hook failed for a batch from %s", batch.source.id)
            fut.set_result(WriteResult(job.accepted, job.duplicates, job.conflicts, sorted(job.foreign)))
