"""Append-only, size-capped, crash-safe disk spool of encoded batches.

Layout: one folder per source holding segment files ``<12-digit id>.seg``, a ``cursor`` file, a
``lock`` file and the producer's key (``producer``, see ``Spool.producer_key``).
A record is a 20-byte header followed by its payload (the exact ``POST /v1/events`` body)::

    magic b"CLS1" | payload length u32 | event count u32 | crc32(payload) u32 | crc32(first 12 bytes) u32

Records are appended to the newest segment; a segment past ``segment_bytes`` is closed and a new one
started. The reader walks from the cursor (segment id, byte offset) in order. ``read(start, ...)``
returns consecutive records from a position without consuming them (the exporter reads ahead of the
batches it has in flight), ``release(end)`` moves the cursor to a position returned by ``read`` and
deletes the segments consumed before it; ``peek()``/``pop()`` do the same one record at a time. The
cursor is replaced atomically but not fsynced: after a crash at most the last few delivered records are
replayed again, which the ledger dedupes by (source, seq).

Torn records: a process killed mid-append leaves a short last record; at open the spool truncates that
tail. A record whose header or payload checksum fails (a truncated file that was appended to again, or
disk damage) is skipped by scanning forward for the next valid header. Either way the record is counted
in ``torn_records`` (and its event count, when the header survived, in ``torn_events``), never replayed.

The spool is used by one thread (the exporter's worker) and one process (an exclusive ``flock``).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import os
import secrets
import struct
import zlib
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)

MAGIC = b"CLS1"
_HEADER = struct.Struct("<4sIIII")
HEADER_SIZE = _HEADER.size
MAX_RECORD_BYTES = 1 << 30
_SEGMENT_SUFFIX = ".seg"


class SpoolError(RuntimeError):
    """The spool folder cannot be used (permissions, or another process holds it)."""


class SpoolRecord(NamedTuple):
    payload: bytes  # the encoded batch, sent as is
    events: int  # events in the batch


class SpoolPos(NamedTuple):
    """A place in the spool: segment id and byte offset in it."""

    seg: int
    off: int


class SpoolRead(NamedTuple):
    """What ``read`` found: records in order, the position just past each, and where the next read
    continues (past any torn records after the last one)."""

    records: list[SpoolRecord]
    ends: list[SpoolPos]
    end: SpoolPos


def _header(payload: bytes, events: int) -> bytes:
    head = struct.pack("<4sII", MAGIC, len(payload), events)
    return head + struct.pack("<II", zlib.crc32(payload), zlib.crc32(head))


def _parse_header(raw: bytes) -> tuple[int, int, int] | None:
    """(payload length, events, payload crc) of a valid header, else None."""
    if len(raw) < HEADER_SIZE:
        return None
    magic, length, events, crc, head_crc = _HEADER.unpack_from(raw)
    if magic != MAGIC or zlib.crc32(raw[:12]) != head_crc or length > MAX_RECORD_BYTES:
        return None
    return length, events, crc


def new_producer_key() -> str:
    """A producer key (``engine_hooks.events.PRODUCER_HEADER``): 192 random bits."""
    return secrets.token_urlsafe(24)


class Spool:
    """FIFO of records on disk; see the module docstring for the format and guarantees."""

    def producer_key(self) -> str:
        """The key of the producer owning this folder (``producer``, created on first use, owner-only):
        a restarted exporter with its spool is the same producer, so the ledger takes its batches."""
        path = self.directory / "producer"
        try:
            key = path.read_text().strip()
        except FileNotFoundError:
            key = ""
        if key:
            return key
        key = new_producer_key()
        tmp = self.directory / "producer.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return key

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int, segment_bytes: int, fsync: bool):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self.torn_records = 0  # records found damaged and skipped (never replayed)
        self.torn_events = 0  # events in those records, where their header survived
        self._unreported_torn_events = 0
        self._unreported_torn_records = 0
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise SpoolError(f"cannot use spool folder {self.directory}: {exc}") from exc
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise SpoolError(
                f"spool folder {self.directory} is in use by another process (two exporters with the same "
                "source_id?)"
            ) from exc
        self._pending_events = 0
        self._pending_records = 0
        self._peeked: SpoolRead | None = None  # what the last peek() returned, for pop()
        self._torn_at: set[SpoolPos] = set()  # torn records counted already (read() may pass them again)
        self._write_fd: int | None = None
        self._read_fd: int | None = None
        self._read_fd_seg = -1
        try:
            self._segments: list[int] = sorted(
                int(p.name[: -len(_SEGMENT_SUFFIX)])
                for p in self.directory.glob("*" + _SEGMENT_SUFFIX)
                if p.name[: -len(_SEGMENT_SUFFIX)].isdigit()
            )
            self._sizes: dict[int, int] = {s: self._path(s).stat().st_size for s in self._segments}
            self._next_id = (self._segments[-1] + 1) if self._segments else 0
            self._read_off = self._load_cursor()  # offset in the oldest segment (older ones are deleted)
            self._recover()
        except OSError as exc:
            self.close()
            raise SpoolError(f"cannot read spool folder {self.directory}: {exc}") from exc

    # -- public API -------------------------------------------------------------------------------

    @property
    def size_bytes(self) -> int:
        """Bytes the spool occupies on disk (a segment's delivered part counts until it is deleted)."""
        return sum(self._sizes.values())

    @property
    def pending_events(self) -> int:
        """Events waiting to be replayed (exact unless damage was found mid-file)."""
        return self._pending_events

    @property
    def pending_records(self) -> int:
        return self._pending_records

    def __bool__(self) -> bool:
        """Whether anything is left to replay (from positions, not from the counters)."""
        try:  # may be asked from another thread (force_flush) while the worker changes the segments
            segments = self._segments
            if not segments:
                return False
            return len(segments) > 1 or self._read_off < self._sizes[segments[0]]
        except (IndexError, KeyError):
            return True

    def take_torn(self) -> tuple[int, int]:
        """(records, events) found torn since the previous call, for the exporter's drop marker."""
        out = self._unreported_torn_records, self._unreported_torn_events
        self._unreported_torn_records = self._unreported_torn_events = 0
        return out

    def append(self, payload: bytes, events: int) -> bool:
        """Append one record; False (nothing written) when it would exceed ``max_bytes``.

        Raises OSError when the disk refuses the write (the exporter counts it and holds the batch).
        """
        size = HEADER_SIZE + len(payload)
        if self.size_bytes + size > self.max_bytes:
            return False
        if not self._segments or (
            self._sizes[self._segments[-1]] > 0
            and self._sizes[self._segments[-1]] + size > self.segment_bytes
        ):
            self._new_segment()
        seg = self._segments[-1]
        fd = self._writer(seg)
        data = _header(payload, events) + payload
        start = self._sizes[seg]
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"short write to spool ({written} of {len(data)} bytes)")
            if self.fsync:
                os.fsync(fd)
        except OSError:
            with contextlib.suppress(OSError):  # leave no partial record behind
                os.ftruncate(fd, start)
            raise
        self._sizes[seg] = start + len(data)
        self._pending_records += 1
        self._pending_events += events
        return True

    def read(self, start: SpoolPos | None, *, max_events: int, max_bytes: int) -> SpoolRead:
        """Consecutive records from ``start`` (None: the oldest undelivered one), without consuming them.

        Stops before the record that would pass ``max_events`` or ``max_bytes`` (but returns at least
        one record when there is one) and at the end of the spool. Torn records are skipped and counted
        once. ``end`` is where the next read continues and what ``release`` takes.
        """
        pos = self.head() if start is None else start
        records: list[SpoolRecord] = []
        ends: list[SpoolPos] = []
        events = size = 0
        while True:
            seg_size = self._sizes.get(pos.seg)
            if seg_size is None or pos.off >= seg_size:
                i = bisect.bisect_right(self._segments, pos.seg)
                if i >= len(self._segments):
                    break
                pos = SpoolPos(self._segments[i], 0)
                continue
            fd = self._reader(pos.seg)
            parsed = _parse_header(os.pread(fd, HEADER_SIZE, pos.off))
            if parsed is not None:
                length, n, crc = parsed
                if records and (events + n > max_events or size + length > max_bytes):
                    break
                payload = os.pread(fd, length, pos.off + HEADER_SIZE)
                if len(payload) == length and zlib.crc32(payload) == crc:
                    records.append(SpoolRecord(payload, n))
                    events += n
                    size += length
                    pos = SpoolPos(pos.seg, pos.off + HEADER_SIZE + length)
                    ends.append(pos)
                    continue
            if pos not in self._torn_at:
                self._torn_at.add(pos)
                self._count_torn(parsed[1] if parsed is not None else 0)
            pos = SpoolPos(pos.seg, self._resync(fd, pos.off + 1, seg_size))
        return SpoolRead(records, ends, pos)

    def head(self) -> SpoolPos:
        """The position of the oldest undelivered record (the cursor)."""
        if not self._segments:
            return SpoolPos(self._next_id, 0)
        return SpoolPos(self._segments[0], self._read_off)

    def release(self, end: SpoolPos, records: int, events: int) -> None:
        """Mark everything before ``end`` delivered (``records`` and ``events``: what that was)."""
        while self._segments and self._segments[0] < end.seg:
            self._drop_segment(self._segments[0])
        if self._segments and self._segments[0] == end.seg:
            self._read_off = max(self._read_off, end.off)
            if self._read_off >= self._sizes[end.seg]:  # consumed: delete it (the newest one too)
                self._drop_segment(end.seg)
        self._pending_records = max(0, self._pending_records - records)
        self._pending_events = max(0, self._pending_events - events)
        head = self.head()
        self._torn_at = {p for p in self._torn_at if p >= head}
        if not self._segments:
            self._pending_records = self._pending_events = 0
        self._save_cursor()

    def peek(self) -> SpoolRecord | None:
        """The oldest undelivered record, skipping (and counting) torn ones; None when empty."""
        got = self.read(None, max_events=0, max_bytes=0)
        if not got.records:
            self._peeked = None
            # nothing valid left: forget the torn tail read passed, and any segments it consumed
            self.release(got.end, 0, 0)
            self._pending_records = self._pending_events = 0
            return None
        self._peeked = got
        return got.records[0]

    def pop(self) -> None:
        """Mark the record returned by the last ``peek()`` delivered."""
        got = self._peeked
        if got is None:
            raise RuntimeError("pop() without a successful peek()")
        self._peeked = None
        self.release(got.ends[0], 1, got.records[0].events)

    def close(self) -> None:
        for fd in (self._write_fd, self._read_fd, self._lock_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._write_fd = self._read_fd = None

    # -- internals --------------------------------------------------------------------------------

    def _path(self, seg: int) -> Path:
        return self.directory / f"{seg:012d}{_SEGMENT_SUFFIX}"

    def _load_cursor(self) -> int:
        """Read offset in the oldest segment; segments older than the cursor's were delivered."""
        try:
            seg_text, off_text = (self.directory / "cursor").read_text().split()
            seg, off = int(seg_text), int(off_text)
        except (OSError, ValueError):
            return 0
        self._next_id = max(self._next_id, seg + 1)
        while self._segments and self._segments[0] < seg:  # a delete that did not happen before a crash
            self._drop_segment(self._segments[0])
        if self._segments and self._segments[0] == seg:
            return min(off, self._sizes[seg])
        return 0

    def _save_cursor(self) -> None:
        seg = self._segments[0] if self._segments else self._next_id
        tmp = self.directory / "cursor.tmp"
        try:
            tmp.write_text(f"{seg} {self._read_off if self._segments else 0}\n")
            os.replace(tmp, self.directory / "cursor")
        except OSError as exc:  # a stale cursor only means re-sending delivered records (deduped)
            log.warning("cannot save spool cursor in %s: %s", self.directory, exc)

    def _new_segment(self) -> None:
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        if not self._segments:
            self._read_off = 0
        seg = self._next_id
        self._next_id += 1
        self._path(seg).touch()
        self._segments.append(seg)
        self._sizes[seg] = 0

    def _writer(self, seg: int) -> int:
        if self._write_fd is None:
            self._write_fd = os.open(self._path(seg), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self._write_fd

    def _reader(self, seg: int) -> int:
        if self._read_fd_seg != seg or self._read_fd is None:
            if self._read_fd is not None:
                os.close(self._read_fd)
            self._read_fd = os.open(self._path(seg), os.O_RDONLY)
            self._read_fd_seg = seg
        return self._read_fd

    def _drop_segment(self, seg: int) -> None:
        """Delete a consumed segment; the read position moves to the start of the next one."""
        if self._read_fd_seg == seg and self._read_fd is not None:
            os.close(self._read_fd)
            self._read_fd, self._read_fd_seg = None, -1
        if seg == self._segments[-1] and self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        with contextlib.suppress(FileNotFoundError):
            self._path(seg).unlink()
        self._segments.remove(seg)
        del self._sizes[seg]
        self._read_off = 0

    def _resync(self, fd: int, start: int, size: int) -> int:
        """Offset of the next valid header at or after ``start`` (``size`` when there is none)."""
        pos = start
        while pos < size:
            window = os.pread(fd, min(1 << 20, size - pos), pos)
            idx = window.find(MAGIC)
            while idx >= 0:
                parsed = _parse_header(os.pread(fd, HEADER_SIZE, pos + idx))
                if parsed is not None and pos + idx + HEADER_SIZE + parsed[0] <= size:
                    return pos + idx
                idx = window.find(MAGIC, idx + 1)
            pos += max(1, len(window) - HEADER_SIZE)
        return size

    def _count_torn(self, events: int) -> None:
        self.torn_records += 1
        self._unreported_torn_records += 1
        self.torn_events += events
        self._unreported_torn_events += events
        self._pending_records = max(0, self._pending_records - 1)
        self._pending_events = max(0, self._pending_events - events)
        log.warning("spool %s: skipped a torn record (%d events)", self.directory, events)

    def _recover(self) -> None:
        """Count pending records from their headers; cut a torn tail off the newest segment.

        A tail shorter than its header claims is what a crash mid-append leaves: it is truncated (and
        counted) so that new appends start on a record boundary. Damage with valid records after it is
        left for the reader, which skips it by resyncing.
        """
        for seg in list(self._segments):
            size = self._sizes[seg]
            off = self._read_off if seg == self._segments[0] else 0
            fd = os.open(self._path(seg), os.O_RDWR)
            try:
                parsed: tuple[int, int, int] | None = None
                while off < size:
                    parsed = _parse_header(os.pread(fd, HEADER_SIZE, off))
                    if parsed is None or off + HEADER_SIZE + parsed[0] > size:
                        break
                    self._pending_records += 1
                    self._pending_events += parsed[1]
                    off += HEADER_SIZE + parsed[0]
                if off < size:
                    valid_after = self._resync(fd, off + 1, size) < size
                    if seg == self._segments[-1] and not valid_after:
                        self._count_torn(parsed[1] if parsed is not None else 0)
                        os.ftruncate(fd, off)
                        self._sizes[seg] = off
            finally:
                os.close(fd)
        if self._segments and not self:  # everything already delivered
            for seg in list(self._segments):
                self._drop_segment(seg)
        if self._pending_records:
            log.info(
                "spool %s: %d batches (%d events) waiting to be replayed",
                self.directory,
                self._pending_records,
                self._pending_events,
            )
