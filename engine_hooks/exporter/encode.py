"""Numbering and encoding: queue entries become ``Prepared`` batches, spooled batches merged POSTs.

Sequence numbers: the order of events is fixed when they are emitted (one FIFO deque); the worker
numbers them in that order as it takes them, before the first send attempt, and a number never changes
afterwards (retries and spool replays re-send the same bytes). The first number is ``seq_start`` or the
current time in microseconds, so a restarted source continues above its previous run.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import msgspec

from engine_hooks.columnar import encode_batch, is_message
from engine_hooks.events import Batch, Dropped, Event, Source, batch_encoder
from engine_hooks.exporter.logonce import LogOnce
from engine_hooks.exporter.queue import MARKER, Layout
from engine_hooks.spool import SpoolRecord

_batch_validator = msgspec.json.Decoder(Batch)
_event_validator = msgspec.json.Decoder(Event)


class Prepared(NamedTuple):
    """A numbered, encoded batch: what is POSTed and, when that fails, spooled."""

    body: bytes
    events: int
    first_seq: int
    last_seq: int
    markers_only: bool = False


class _RawBatch(msgspec.Struct):
    """A spooled body, its events left encoded (to merge consecutive records into one POST)."""

    source: msgspec.Raw
    events: list[msgspec.Raw]
    schema_version: int = 1


_raw_batch = msgspec.json.Decoder(_RawBatch)


def merge_records(records: Sequence[SpoolRecord]) -> tuple[bytes, int, int]:
    """One body from the longest prefix of ``records`` that shares its source and schema version (JSON
    batches; a columnar message is sent alone).

    Returns (body, records used, events). The events keep their seq order (the spool holds batches in
    seq order), so the ledger takes the merged batch as it would take the records one by one.
    """
    if len(records) == 1 or is_message(records[0].payload):  # a columnar message is sent as it is
        return records[0].payload, 1, records[0].events
    first = _raw_batch.decode(records[0].payload)
    events = list(first.events)
    used, count = 1, records[0].events
    for record in records[1:]:
        if is_message(record.payload):
            break
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


class Encoder:
    """Numbers, builds, validates and encodes events (worker thread only): JSON batches, or columnar
    messages while ``columns()`` says so.

    ``next_seq`` is the number the next event gets; ``first_seq`` the first this source run gave.
    ``record_drop(reason, n)`` counts events that cannot be built or fail the contract's validation.
    """

    def __init__(
        self,
        source: Source,
        batch_size: int,
        seq_start: int,
        log: LogOnce,
        record_drop: Callable[[str, int], None],
        columns: Callable[[], bool] = lambda: False,
    ):
        self.columns = columns  # whether to send the columnar message now (else JSON)
        self._source = source
        self._batch_size = batch_size
        self._log = log
        self._record_drop = record_drop
        self.next_seq = self.first_seq = seq_start

    def prepare(self, entries: Iterable[tuple[Layout, Any]]) -> list[Prepared]:
        """Number, build and encode events in queue order; cut into batches of ``batch_size``."""
        events: list[Event] = []
        markers: set[int] = set()
        invalid = 0
        seq = self.next_seq
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
            if layout is MARKER:
                markers.update(range(seq - len(rows), seq))
        prepared = self._encode(events, markers)
        if prepared is None:  # something failed the contract's validation: find it, renumber the rest
            good = [ev for ev in events if self._valid(ev)]
            invalid += len(events) - len(good)
            events = [msgspec.structs.replace(ev, seq=self.next_seq + i) for i, ev in enumerate(good)]
            markers = {self.next_seq + i for i, ev in enumerate(events) if isinstance(ev, Dropped)}
            prepared = self._encode(events, markers) or []
        self.next_seq += len(events)
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
            if self.columns():
                # checked as JSON above (an invalid event is dropped alone), then sent as columns; a
                # number a column cannot hold stays JSON, whose check names it
                with contextlib.suppress(struct.error):
                    body = encode_batch(Batch(source=self._source, events=chunk))
            first, last = chunk[0].seq, chunk[-1].seq
            markers_only = all(s in markers for s in range(first, last + 1)) if markers else False
            out.append(Prepared(body, len(chunk), first, last, markers_only))
        return out
