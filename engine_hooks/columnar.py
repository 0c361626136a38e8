"""The columnar message: an exporter flush of steps as packed columns (msgpack), and its encoder.

One message carries a source's events of one flush: its engine steps as columns in three little-endian
blocks (int64, float64, int32: each type's columns side by side, so one numpy call checks a block on
the ledger), and the events other than steps as the contract's own Structs (``engine_hooks.events``).
The request ids the steps name travel once a message, packed as Arrow's string layout (UTF-8 bytes and
int32 offsets); a step's ``request_ids`` and ``stalled_request_ids`` travel as keys into them (0..k-1 in
order of first use, every message carrying the ids of all the requests it names). The format and why:
``docs/benchmarks.md``, "A columnar wire: which format" (``bench/wire.py``, candidate ``msgpack-all``).

The encoder runs on the exporter's worker thread, never the engine thread; it imports only msgspec
and the standard library. The ledger's decoder and checks: ``ledger/columnar.py``.

The exporter sends it when ``wire = "columns"`` (``engine_hooks/exporter/encode.py``), ``POST /v1/events``
reads it by its media type (``MEDIA_TYPE``).
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain, pairwise
from typing import Any

import msgspec

from engine_hooks import events as ev

MEDIA_TYPE = "application/vnd.chunkledger.columns+msgpack"
WIRE_VERSION = 1  # of the envelope and the column layout below; the events' own is SCHEMA_VERSION

# A step's scalar fields by type, seq first. The packed form keeps each type in one block: int64
# (3 x n), float64 (3 x n), then int32: the int32 scalars (7 x n), every list's offsets (6 x (n + 1))
# and every list's values.
I64 = ("seq", "step", "prefill_depth_tokens")
F64 = ("ts", "duration_s", "kv_usage")
I32 = (
    "prefill_tokens",
    "decode_tokens",
    "num_prefill_reqs",
    "num_decode_reqs",
    "running",
    "waiting",
    "max_prefill_depth",
)
SCALARS = (*I64[1:], *F64, *I32)  # the Step fields
# List columns of a step (int32 values and offsets), in block order; the two id lists travel as keys.
LISTS = (
    "request_ids",
    "stalled_request_ids",
    "stalled_kv_blocks",
    "token_counts",
    "token_totals",
    "token_ids",
)
COLUMN = {"request_ids": "request_keys", "stalled_request_ids": "stalled_keys", **{n: n for n in LISTS[2:]}}
COLUMNS = tuple(COLUMN[n] for n in LISTS)  # the list columns' names on the wire
FIELD = {v: k for k, v in COLUMN.items()}  # column -> the Step field it carries (for errors)
ID_LISTS = ("request_ids", "stalled_request_ids")
STEP_ORDER = (*SCALARS, *LISTS)  # a step's values as the encoder takes them from a queue entry
STEP_COLUMN_ORDER = ("seq", *STEP_ORDER)  # a message's step columns as ``assemble`` takes them

Entry = tuple[Any, Any]  # an exporter queue entry: (Layout, values), engine_hooks/exporter/queue.py


class PackedSteps(msgspec.Struct, array_like=True):
    """A message's steps: ``n`` steps, the number of values of each list column (``LISTS`` order), and
    the three blocks in one buffer: int64 (3 x n: ``I64``), float64 (3 x n: ``F64``), int32 (``I32``
    scalars 7 x n, then each list's offsets (n + 1) and then each list's values). Each block but the
    last is a multiple of 8 bytes long, so all are aligned once the buffer is."""

    n: int
    counts: list[int]
    data: memoryview


class Message(msgspec.Struct, kw_only=True):
    """The columnar message (msgpack), one exporter flush of a source."""

    source: ev.Source
    wire_version: int = WIRE_VERSION
    schema_version: int = ev.SCHEMA_VERSION
    ids: memoryview  # UTF-8 request ids, packed; key i is the i-th
    id_offsets: memoryview  # int32 little-endian, len(ids) + 1
    events: list[ev.Event] = []  # the other events (queued, chunk, finished, ...): the contract's Structs
    steps: PackedSteps


@dataclass
class Packed:
    """The step columns in their three little-endian blocks (see ``PackedSteps``)."""

    n: int  # steps
    counts: list[int]  # values of each list column, in LISTS order
    i64: bytes | memoryview
    f64: bytes | memoryview
    i32: bytes | memoryview

    def wire(self) -> PackedSteps:
        return PackedSteps(self.n, self.counts, memoryview(b"".join((self.i64, self.f64, self.i32))))


def _step_default(name: str) -> Any:
    f = next(f for f in msgspec.structs.fields(ev.Step) if f.name == name)
    if f.default_factory is not msgspec.NODEFAULT:
        return f.default_factory()
    return f.default


_getters: dict[tuple[str, ...], Callable[[Any], tuple[Any, ...]]] = {}


def _step_getter(names: tuple[str, ...]) -> Callable[[Any], tuple[Any, ...]]:
    """row -> the step's values in ``STEP_ORDER`` for a layout's field order (one ``itemgetter`` when
    the layout names every field, as the plugin's does)."""
    get = _getters.get(names)
    if get is None:
        idx = [names.index(n) if n in names else None for n in STEP_ORDER]
        if all(i is not None for i in idx):
            get = operator.itemgetter(*idx)  # type: ignore[arg-type]
        else:
            defaults = [_step_default(n) for n in STEP_ORDER]

            def get(row: Any) -> tuple[Any, ...]:
                return tuple(row[i] if i is not None else d for i, d in zip(idx, defaults, strict=True))

        _getters[names] = get
    return get


def pack(code: str, values: Sequence[Any]) -> bytes:
    """Python numbers as a little-endian array (``struct``: about twice as fast as ``array`` or numpy
    from a list). Raises ``struct.error`` for a value outside the type."""
    return struct.pack(f"<{len(values)}{code}", *values)


@dataclass
class Flat:
    """One message's steps as columns of Python values, and its other events."""

    seq: list[int]
    cols: dict[str, Sequence[Any]]  # by Step field: the scalars, and per list one list a step
    events: list[ev.Event]


def flatten(entries: Iterable[Entry], seq: int) -> tuple[Flat, int]:
    """Queue entries numbered from ``seq`` as the exporter numbers them: steps to columns, the other
    events built as today. Returns the next seq too."""
    steps: list[tuple[Any, ...]] = []
    seqs: list[int] = []
    events: list[ev.Event] = []
    step_kind = ev.Step
    for layout, values in entries:
        rows = values if layout.many else (values,)
        if layout.kind is step_kind:
            get = _step_getter(layout.fields) if not isinstance(values, dict) else None
            for row in rows:
                steps.append(get(row) if get else tuple(row.get(n, _step_default(n)) for n in STEP_ORDER))
                seqs.append(seq)
                seq += 1
        else:
            build = layout.build
            for row in rows:
                events.append(build(seq, row))
                seq += 1
    cols: list[Sequence[Any]] = list(zip(*steps, strict=True)) if steps else [()] * len(STEP_ORDER)
    return Flat(seqs, dict(zip(STEP_ORDER, cols, strict=True)), events), seq


def pack_steps(seq: list[int], cols: dict[str, Sequence[Any]], keys: dict[str, list[int]]) -> Packed:
    """``cols``: the scalar columns and the per-step lists; ``keys``: the two id lists' keys, flattened.
    One ``struct.pack`` a block, straight from the steps' own lists. Raises ``struct.error`` for a
    value outside its type."""
    n = len(seq)
    counts = [len(keys[name]) if name in keys else sum(map(len, cols[name])) for name in LISTS]
    i32 = chain(
        *(cols[c] for c in I32),
        *(accumulate(map(len, cols[name]), initial=0) for name in LISTS),
        *(keys[name] if name in keys else chain.from_iterable(cols[name]) for name in LISTS),
    )
    return Packed(
        n,
        counts,
        struct.pack(f"<{3 * n}q", *seq, *cols["step"], *cols["prefill_depth_tokens"]),
        struct.pack(f"<{3 * n}d", *cols["ts"], *cols["duration_s"], *cols["kv_usage"]),
        struct.pack(f"<{7 * n + 6 * (n + 1) + sum(counts)}i", *i32),
    )


def assign_keys(runners: list[str], stalled: list[str]) -> tuple[list[int], list[int], list[str]]:
    """Keys per message, 0..k-1 in order of first use (the runners', then the stalled): (the runners'
    keys, the stalled's keys, the ids of keys 0..k-1)."""
    ids = list(dict.fromkeys(chain(runners, stalled)))
    get = dict(zip(ids, range(len(ids)), strict=True)).__getitem__
    return list(map(get, runners)), list(map(get, stalled)), ids


def pack_ids(ids: list[str]) -> tuple[bytes, bytes]:
    """Request ids as one UTF-8 buffer and int32 offsets (Arrow's string layout)."""
    joined = "".join(ids)
    data = joined.encode()
    lens = map(len, ids) if len(data) == len(joined) else (len(s.encode()) for s in ids)
    return data, pack("i", list(accumulate(lens, initial=0)))


encoder = msgspec.msgpack.Encoder()


class ColumnarEncoder:
    """Queue entries to columnar messages, numbering the events from ``seq_start`` as the exporter's
    JSON encoder does. Checks nothing beyond the types the packing needs (``struct.error`` for a
    number outside its column's type): the ledger checks the contract (``ledger/columnar.py``)."""

    def __init__(self, source: ev.Source, seq_start: int) -> None:
        self.source, self.next_seq = source, seq_start

    def message(self, entries: Iterable[Entry]) -> Message:
        """The entries as one message (the seqs they take are used even if it is not sent)."""
        flat, self.next_seq = flatten(entries, self.next_seq)
        return message_of(self.source, flat)

    def __call__(self, entries: Iterable[Entry]) -> bytes:
        return encoder.encode(self.message(entries))


def message_of(source: ev.Source, flat: Flat, schema_version: int = ev.SCHEMA_VERSION) -> Message:
    """One message from steps as columns and the other events."""
    cols = flat.cols
    runners, stalled = (list(chain.from_iterable(cols[n])) for n in ID_LISTS)
    rkeys, skeys, ids = assign_keys(runners, stalled)
    packed = pack_steps(flat.seq, cols, dict(zip(ID_LISTS, (rkeys, skeys), strict=True)))
    data, id_offsets = pack_ids(ids)
    return Message(
        source=source,
        schema_version=schema_version,
        ids=memoryview(data),
        id_offsets=memoryview(id_offsets),
        events=flat.events,
        steps=packed.wire(),
    )


def encode_batch(batch: ev.Batch) -> bytes:
    """A contract batch as one columnar message, its steps as columns and its other events as they are:
    for a source that builds events rather than queue entries. Raises ``struct.error`` for a number
    outside its column's type."""
    steps = [e for e in batch.events if type(e) is ev.Step]
    cols: dict[str, Sequence[Any]] = {name: [getattr(e, name) for e in steps] for name in STEP_ORDER}
    flat = Flat([e.seq for e in steps], cols, [e for e in batch.events if type(e) is not ev.Step])
    return encoder.encode(message_of(batch.source, flat, batch.schema_version))


def is_message(body: bytes) -> bool:
    """Whether a body the exporter made is a columnar message (a msgpack map), not a JSON batch."""
    return bool(body) and (0x80 <= body[0] <= 0x8F or body[0] in (0xDE, 0xDF))


def as_json(body: bytes) -> bytes:
    """A columnar message as the JSON batch of the same events."""
    return ev.batch_encoder.encode(decode_to_batch(body))


def decode_to_batch(body: bytes) -> ev.Batch:
    """A columnar message back to the contract's batch, its events in seq order (standard library and
    msgspec only): how an exporter re-sends as JSON what a ledger that cannot read columns refused.
    Checks only what unpacking needs (the ledger's ``decode_columns`` checks the contract); raises
    ``msgspec.DecodeError`` or ``ValueError`` for a body that is not a message."""
    msg = msgspec.msgpack.decode(body, type=Message)
    p, n = msg.steps, msg.steps.n
    data = bytes(p.data)
    if n < 0 or len(p.counts) != len(LISTS) or len(data) != 48 * n + 4 * (13 * n + 6 + sum(p.counts)):
        raise ValueError(f"{len(data)} bytes for {n} steps and {p.counts} values")
    i64 = struct.unpack_from(f"<{3 * n}q", data)
    f64 = struct.unpack_from(f"<{3 * n}d", data, 24 * n)
    i32 = struct.unpack_from(f"<{13 * n + 6 + sum(p.counts)}i", data, 48 * n)
    offsets = [i32[7 * n + k * (n + 1) : 7 * n + (k + 1) * (n + 1)] for k in range(len(LISTS))]
    at = 13 * n + 6
    raw = bytes(msg.ids)
    bounds = struct.unpack(f"<{len(msg.id_offsets) // 4}i", bytes(msg.id_offsets))
    ids = [raw[a:b].decode() for a, b in pairwise(bounds)]
    cols: dict[str, Sequence[Any]] = {name: i64[k * n : (k + 1) * n] for k, name in enumerate(I64[1:], 1)}
    cols |= {name: f64[k * n : (k + 1) * n] for k, name in enumerate(F64)}
    cols |= {name: i32[k * n : (k + 1) * n] for k, name in enumerate(I32)}
    for name, off, count in zip(LISTS, offsets, p.counts, strict=True):
        values: Sequence[Any] = i32[at : at + count]
        at += count
        if name in ID_LISTS:
            values = [ids[k] for k in values]
        cols[name] = [list(values[a:b]) for a, b in pairwise(off)]
    cols["seq"] = i64[:n]
    return assemble(msg.source, msg.schema_version, [cols[name] for name in STEP_COLUMN_ORDER], msg.events)


def assemble(
    source: ev.Source, schema_version: int, columns: Sequence[Sequence[Any]], events: list[ev.Event]
) -> ev.Batch:
    """The contract's batch from a message's steps as columns (in ``STEP_COLUMN_ORDER``, one value a
    step; each list column a list a step, the id lists as ids) and its other events, in seq order."""
    rows = zip(*columns, strict=True)
    steps: list[ev.Event] = [ev.Step(**dict(zip(STEP_COLUMN_ORDER, row, strict=True))) for row in rows]
    merged = sorted([*steps, *events], key=operator.attrgetter("seq")) if events else steps
    return ev.Batch(source=source, events=merged, schema_version=schema_version)
