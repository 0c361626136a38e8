"""The columnar message (``engine_hooks/columnar.py``) decoded into validated columns.

All or nothing, as ``decode_batch``: a message that breaks the contract raises ``BadBatch``, its
``FieldError``s naming (event index, field) as ``decode_batch`` names them for the same events sent as
JSON (the index of an event in the message's seq order, a step's list entry as ``request_ids[3]``).
The whole message is checked in a few numpy calls (``steps_ok``); only a message that fails is looked
at column by column to name the field (``step_errors``).

``POST /v1/events`` takes a message sent with its media type (``MEDIA_TYPE``) and hands the rule engine
and the store its ``Columns.batch()``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain, pairwise
from typing import Any

import msgspec
import numpy as np

from engine_hooks import columnar as wire
from engine_hooks import events as ev
from engine_hooks.columnar import COLUMNS, F64, FIELD, I32, I64, LISTS, Packed, PackedSteps
from ledger.validation import (
    DOT_SEGMENTS,
    BadBatch,
    FieldError,
    bad_id,
    from_validation_error,
    nfc,
    nul_fields,
)

_I64, _F64, _I32 = np.dtype("<i8"), np.dtype("<f8"), np.dtype("<i4")
_MAX_ERRORS = 20


@dataclass
class Steps:
    """A message's steps as numpy views over the three blocks (no Python object per row)."""

    n: int
    i64: np.ndarray  # 3 x n: seq, step, prefill_depth_tokens
    f64: np.ndarray  # 3 x n: ts, duration_s, kv_usage
    i32: np.ndarray  # 7 x n: I32
    offsets2d: np.ndarray  # 6 x (n + 1): each list's offsets, in LISTS order
    values: dict[str, np.ndarray]  # by column (request_keys, stalled_keys, token_counts, ...)
    nonneg: list[np.ndarray]  # every int32 array that must hold no negative number

    @property
    def seq(self) -> np.ndarray:
        return self.i64[0]

    def scalar(self, name: str) -> np.ndarray:
        if name in I32:
            return self.i32[I32.index(name)]
        if name in F64:
            return self.f64[F64.index(name)]
        return self.i64[I64.index(name)]

    def offsets(self, column: str) -> np.ndarray:
        return self.offsets2d[COLUMNS.index(column)]

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        """6 x n: each list column's values per step, in ``LISTS`` order."""
        return np.diff(self.offsets2d, axis=1)

    @classmethod
    def view(cls, p: Packed) -> Steps:
        """Views over packed blocks; raises ValueError when their sizes do not add up."""
        n = p.n
        if n < 0 or len(p.counts) != len(LISTS) or min(p.counts, default=0) < 0:
            raise ValueError(f"{n} steps, {p.counts} values")
        i32 = np.frombuffer(p.i32, _I32)
        at = 7 * n + 6 * (n + 1)
        if len(i32) != at + sum(p.counts):
            raise ValueError(f"{len(i32)} int32 values, not {at + sum(p.counts)}")
        values = {}
        for name, count in zip(COLUMNS, p.counts, strict=True):
            values[name] = i32[at : at + count]
            at += count
        return cls(
            n,
            np.frombuffer(p.i64, _I64).reshape(3, n),
            np.frombuffer(p.f64, _F64).reshape(3, n),
            i32[: 7 * n].reshape(7, n),
            i32[7 * n : 7 * n + 6 * (n + 1)].reshape(6, n + 1),
            values,
            [i32],
        )

    @classmethod
    def from_wire(cls, steps: PackedSteps, copy: bool = True) -> Steps:
        """Views over a message's steps (``copy``: over one copy of its buffer, at an aligned address:
        a bin field lands anywhere in a msgpack body, a bytes object's data is aligned); raises
        ValueError when the sizes do not add up."""
        n = steps.n
        data = memoryview(bytes(steps.data)) if copy else steps.data
        if n < 0 or len(data) < 48 * n:
            raise ValueError(f"{len(data)} bytes for {n} steps")
        return cls.view(Packed(n, steps.counts, data[: 24 * n], data[24 * n : 48 * n], data[48 * n :]))


def steps_of(steps: list[ev.Step]) -> tuple[Steps, list[str]]:
    """Step events (checked: a JSON batch's) as the columns a message carries, and the ids their keys
    index: what ``ledger.fold.fold_columns`` folds."""
    cols: dict[str, Sequence[Any]] = {name: [getattr(e, name) for e in steps] for name in wire.STEP_ORDER}
    runners, stalled = (list(chain.from_iterable(cols[n])) for n in wire.ID_LISTS)
    rkeys, skeys, ids = wire.assign_keys(runners, stalled)
    packed = wire.pack_steps(
        [e.seq for e in steps], cols, {"request_ids": rkeys, "stalled_request_ids": skeys}
    )
    return Steps.view(packed), ids


def steps_ok(s: Steps) -> bool:
    """The whole message's columns against the contract in a few numpy calls (the fast path; a message
    that fails it is looked at column by column to name the field: ``step_errors``). Two lists line up
    step by step exactly when their offsets are equal."""
    n = s.n
    o = s.offsets2d
    if n == 0:
        return not any(len(v) for v in s.values.values()) and not o.any()
    if s.i64.min() < 0:
        return False
    seq = s.i64[0]
    if n > 1 and (seq[1:] - seq[:-1]).min() <= 0:
        return False
    lo, hi = s.f64.min(axis=1).tolist(), s.f64.max(axis=1).tolist()  # NaN fails every comparison below
    if not (lo[0] > 0 and hi[0] <= ev.TS_MAX and lo[1] >= 0 and hi[1] <= ev.DURATION_MAX_S):
        return False
    if not (lo[2] >= 0 and hi[2] <= 1):
        return False
    if any(len(a) and a.min() < 0 for a in s.nonneg):
        return False
    ends = o[:, [0, -1]].tolist()
    if ends != [[0, len(s.values[c])] for c in COLUMNS] or (o[:, 1:] - o[:, :-1]).min() < 0:
        return False
    # counts and totals line up with the requests, blocks with the stalled (the exporter's steps always)
    if not (o[3:5] == o[0]).all() or not (o[2] == o[1]).all():
        lens = o[:, 1:] - o[:, :-1]
        r, st, b, c, t, i = lens
        present = (c > 0) | (t > 0) | (i > 0)
        if (present & ((c != r) | (t != c))).any() or ((b > 0) & (b != st)).any():
            return False
    counts, totals = s.values["token_counts"], s.values["token_totals"]
    if len(counts) and (totals < counts).any():
        return False
    if len(s.values["token_ids"]):  # each step's ids: as many as its counts say (or none)
        cs = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))[o[3]]
        if not (cs == o[5]).all():
            got = o[5, 1:] - o[5, :-1]
            if ((got > 0) & (got != cs[1:] - cs[:-1])).any():
                return False
    return True


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def step_errors(s: Steps, position: Callable[[int], int]) -> list[FieldError]:
    """Each failure of ``steps_ok`` named as ``decode_batch`` names it for the same step sent as JSON:
    (``position(i)``: step i's index among the message's events, field[j]). Offsets that are not
    offsets are named by column (``steps.<column>``, no index) and end the check."""
    errors: list[FieldError] = []
    n = s.n

    def at(i: int, name: str, reason: str) -> None:
        errors.append(FieldError(position(i), name, f"{reason} (seq {int(s.seq[i])})"))

    seq = s.seq
    if n and seq.min() < 0:
        at(_first(seq < 0), "seq", "Expected `int` >= 0")
    elif n > 1 and not (seq[1:] > seq[:-1]).all():
        at(_first(seq[1:] <= seq[:-1]) + 1, "seq", "must increase within a batch")
    for name, ok, reason in (
        ("ts", lambda x: (x > 0) & (x <= ev.TS_MAX), f"Expected `float` > 0.0 and <= {ev.TS_MAX}"),
        ("duration_s", lambda x: (x >= 0) & (x <= ev.DURATION_MAX_S), "Expected `float` >= 0.0 and <= 1e9"),
        ("kv_usage", lambda x: (x >= 0) & (x <= 1), "Expected `float` >= 0.0 and <= 1.0"),
    ):
        good = ok(s.scalar(name))
        if not good.all():
            at(_first(~good), name, reason)
    for name in (*I64[1:], *I32):
        col = s.scalar(name)
        if n and col.min() < 0:
            at(_first(col < 0), name, "Expected `int` >= 0")
    o = s.offsets2d
    lens = np.diff(o, axis=1)
    for k, name in enumerate(COLUMNS):
        if o[k, 0] != 0 or o[k, -1] != len(s.values[name]) or (lens[k] < 0).any():
            errors.append(
                FieldError(None, f"steps.{name}", "not offsets of the steps' lists into its values")
            )
    if any(e.index is None for e in errors):
        return errors

    def in_list(name: str, r: int, reason: str) -> None:
        off = s.offsets(name)
        i = int(np.searchsorted(off, r, "right")) - 1
        at(i, f"{FIELD[name]}[{r - int(off[i])}]", reason)

    for name in COLUMNS:
        v = s.values[name]
        if len(v) and v.min() < 0:
            in_list(name, _first(v < 0), "Expected `int` >= 0")
    r, st, bl, cnt, tot, ids = lens
    if ((bl > 0) & (bl != st)).any():
        i = _first((bl > 0) & (bl != st))
        at(i, "stalled_kv_blocks", f"{bl[i]} block counts for {st[i]} stalled requests")
    present = (cnt > 0) | (tot > 0) | (ids > 0)
    if (present & (cnt != r)).any():
        i = _first(present & (cnt != r))
        at(i, "token_counts", f"{cnt[i]} counts for {r[i]} requests: one per request_ids entry")
    elif (present & (tot != cnt)).any():
        i = _first(present & (tot != cnt))
        at(i, "token_totals", f"{tot[i]} totals for {cnt[i]} counts: one per request_ids entry")
    else:
        counts, totals = s.values["token_counts"], s.values["token_totals"]
        if len(counts) and (totals < counts).any():
            j = _first(totals < counts)
            in_list(
                "token_totals", j, f"{int(totals[j])} is less than this step's {int(counts[j])} new tokens"
            )
        sums = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        oc = s.offsets("token_counts")
        bad = (ids > 0) & (ids != sums[oc[1:]] - sums[oc[:-1]])
        if bad.any():
            at(_first(bad), "token_ids", "the new ids of every request in order (or none)")
    return errors


def id_errors(data: bytes, offsets: np.ndarray) -> tuple[list[FieldError], list[tuple[int, str]]]:
    """The request id rules of ``decode_batch`` on packed ids: 1-256 characters, no '/', not a dot
    segment, no NUL, NFC. Byte scans first, per id only where a scan finds something. Returns the
    errors of the layout (``id_offsets``, ``ids[j]`` for bytes that are not UTF-8) and the bad ids as
    (key, reason), to be named where a step first names them."""
    n = len(offsets) - 1
    if n < 0:
        return [FieldError(None, "id_offsets", "no offsets")], []
    if n == 0:
        return ([] if not data else [FieldError(None, "id_offsets", "no offsets for the ids")]), []
    lens = offsets[1:] - offsets[:-1]
    shortest, longest = int(lens.min()), int(lens.max())
    if int(offsets[0]) != 0 or int(offsets[-1]) != len(data) or shortest < 0:
        return [FieldError(None, "id_offsets", f"not offsets of the ids into {len(data)} bytes")], []
    ascii_ = data.isascii()
    if b"/" in data or b"\x00" in data or not ascii_ or longest > 256 or shortest < 1:
        suspects: list[int] = list(range(n))
    elif shortest <= 2:
        suspects = np.flatnonzero(lens <= 2).tolist()  # a dot segment?
    else:
        return [], []
    layout: list[FieldError] = []
    bad: list[tuple[int, str]] = []
    for j in suspects:
        raw = data[offsets[j] : offsets[j + 1]]
        try:
            rid = raw.decode()
        except UnicodeDecodeError:
            layout.append(FieldError(None, f"ids[{j}]", "not UTF-8"))
            continue
        if not rid:
            bad.append((j, "Expected `str` of length >= 1"))
        elif len(rid) > 256:
            bad.append((j, "Expected `str` of length <= 256"))
        elif "\x00" in rid:
            bad.append((j, "text must not contain NUL (\\u0000)"))
        elif "/" in rid or rid in DOT_SEGMENTS or not nfc(rid):
            bad.append((j, bad_id(rid)))
        if len(layout) + len(bad) >= _MAX_ERRORS:
            break
    return layout, bad


_ENGINE_TYPES = frozenset(ev.EVENT_TYPES[k] for k in ev.ENGINE_KINDS | {"dropped", "cutoff_applied"}) - {
    ev.Step
}
_GATEWAY_TYPES = frozenset(ev.EVENT_TYPES[k] for k in ev.GATEWAY_KINDS | {"dropped", "cutoff_applied"})


def event_errors(
    source: ev.Source, events: list[ev.Event], position: Callable[[int], int]
) -> list[FieldError]:
    """The other events, as ``decode_batch`` checks them (``position(j)``: event j's index among the
    message's events): the kinds a source may send (no ``step``: steps travel as columns), seqs
    increasing, request ids. Scans first; per event only to name what a scan found."""
    if not events:
        return []
    allowed = _ENGINE_TYPES if source.kind == "engine" else _GATEWAY_TYPES
    seqs = [e.seq for e in events]
    dropped = ev.Dropped
    rids = [getattr(e, "request_id", "") if type(e) is not dropped else "" for e in events]
    joined = "\x00".join(rids)
    kinds_ok = allowed.issuperset(map(type, events))
    seqs_ok = all(map(operator.lt, seqs, seqs[1:]))
    if kinds_ok and seqs_ok and "/" not in joined and "." not in joined and joined.isascii():
        return []
    errors = []
    prev = -1
    for j, (e, rid) in enumerate(zip(events, rids, strict=True)):
        i = position(j)
        if e.seq <= prev:
            errors.append(FieldError(i, "seq", f"must increase within a batch: {e.seq} after {prev}"))
        prev = e.seq
        kind = e.__struct_config__.tag
        if type(e) not in allowed:
            why = (
                "steps travel as columns" if type(e) is ev.Step else f"a {source.kind} source cannot send it"
            )
            errors.append(FieldError(i, "kind", f"{kind!r} cannot travel here: {why}"))
        if "/" in rid or rid in DOT_SEGMENTS or not nfc(rid):
            errors.append(FieldError(i, "request_id", bad_id(rid)))
    return errors


@dataclass
class Columns:
    """A message, validated: its steps as columns, the request ids its keys stand for (key i: the
    i-th, packed as Arrow's string layout), its other events as the contract's Structs."""

    source: ev.Source
    steps: Steps
    events: list[ev.Event]
    id_data: bytes  # UTF-8
    id_offsets: np.ndarray  # int32, one more than the ids
    schema_version: int = ev.SCHEMA_VERSION  # of its events (the contract's)

    @property
    def rows(self) -> int:
        """(request, step) rows: one per request a step ran."""
        return len(self.steps.values["request_keys"])

    def names(self, keys: np.ndarray) -> list[str]:
        """The request ids of ``keys``."""
        data, off = self.id_data, self.id_offsets.tolist()
        return [data[off[k] : off[k + 1]].decode() for k in keys.tolist()]

    @functools.cached_property
    def ids(self) -> list[str]:
        """The request ids key 0..k-1 stand for."""
        return self.names(np.arange(len(self.id_offsets) - 1))

    def batch(self) -> ev.Batch:
        """The message as the contract's batch, its events in seq order (the order the exporter queued
        them in): what the store and the rules take where they do not read the columns, so every ingest
        guarantee holds on this wire as on JSON. One Struct a step, its lists sliced from the columns
        (ids by key)."""
        s, ids = self.steps, self.ids
        cols: list[list[Any]] = [s.seq.tolist(), *(s.scalar(name).tolist() for name in wire.SCALARS)]
        for name, column in zip(LISTS, COLUMNS, strict=True):
            off, values = s.offsets(column).tolist(), s.values[column].tolist()
            if name in wire.ID_LISTS:
                values = list(map(ids.__getitem__, values))
            cols.append([values[a:b] for a, b in pairwise(off)])
        return wire.assemble(self.source, self.schema_version, cols, self.events)


class _Seq(msgspec.Struct):
    seq: int


class _Version(msgspec.Struct):
    wire_version: int = wire.WIRE_VERSION


def _version(body: bytes) -> int:
    """The wire version a map says it is in (ours when it says none or is not a map)."""
    try:
        return msgspec.msgpack.decode(body, type=_Version).wire_version
    except msgspec.MsgspecError:
        return wire.WIRE_VERSION


def _wire_version_error(version: int) -> FieldError:
    known = wire.WIRE_VERSION
    return FieldError(
        None, "wire_version", f"{version} is {'newer than' if version > known else 'not'} {known}"
    )


class _LazyMessage(msgspec.Struct, kw_only=True):
    """``Message`` with its events left undecoded: to name an event that fails to decode."""

    source: ev.Source
    steps: PackedSteps
    events: list[msgspec.Raw] = []


_message_decoder = msgspec.msgpack.Decoder(wire.Message)
_lazy_decoder = msgspec.msgpack.Decoder(_LazyMessage)
_seq_decoder = msgspec.msgpack.Decoder(_Seq)
_json = msgspec.json.Encoder()


def _positions(
    step_seqs: np.ndarray, event_seqs: list[int]
) -> tuple[Callable[[int], int], Callable[[int], int]]:
    """(step i, event j) -> its index among the message's events in seq order: the order the exporter
    queued them in, that of the same events sent as JSON. (Sorted only when first asked: on the way to
    an error.)"""
    memo: list[np.ndarray] = []

    def sorted_seqs() -> list[np.ndarray]:
        if not memo:
            memo.extend((np.sort(np.asarray(event_seqs, np.int64)), np.sort(step_seqs)))
        return memo

    def step(i: int) -> int:
        return i + int(np.searchsorted(sorted_seqs()[0], step_seqs[i]))

    def event(j: int) -> int:
        return j + int(np.searchsorted(sorted_seqs()[1], event_seqs[j]))

    return step, event


def _undecodable_event(body: bytes, exc: msgspec.ValidationError) -> FieldError:
    """An event that does not decode, named as ``decode_batch`` names it (``$.events[j].field``: j the
    index among the other events, made the index among all)."""
    err = from_validation_error(exc)
    try:
        lazy = _lazy_decoder.decode(body)
        seqs = [_seq_decoder.decode(raw).seq for raw in lazy.events]
        steps = Steps.from_wire(lazy.steps)
    except (msgspec.MsgspecError, ValueError):
        return FieldError(None, f"events[{err.index}].{err.field}", err.reason)
    assert err.index is not None
    _, event = _positions(steps.seq, seqs)
    return FieldError(event(err.index), err.field, err.reason)


def decode_columns(body: bytes, *, max_events: int) -> Columns:
    """Decode and check a columnar message; raise ``BadBatch`` naming what is wrong (as
    ``decode_batch`` names it for the same events sent as JSON)."""
    try:
        msg = _message_decoder.decode(body)
    except msgspec.ValidationError as exc:
        version = _version(body)
        if version != wire.WIRE_VERSION:  # another layout: say so, not what fails to decode as ours
            raise BadBatch([_wire_version_error(version)]) from None
        if str(exc).endswith("`") and "- at `$.events[" in str(exc):
            raise BadBatch([_undecodable_event(body, exc)]) from None
        err = from_validation_error(exc)
        if not err.field:  # not a message at all (msgpack, but not a map)
            err = FieldError(None, "body", err.reason)
        raise BadBatch([err]) from None
    except msgspec.DecodeError as exc:
        raise BadBatch([FieldError(None, "body", f"malformed msgpack: {exc}")]) from None
    except RecursionError:  # msgspec recurses per nesting level, also through unknown fields it skips
        raise BadBatch([FieldError(None, "body", "msgpack nested deeper than the decoder allows")]) from None
    if msg.wire_version != wire.WIRE_VERSION:
        raise BadBatch([_wire_version_error(msg.wire_version)])
    try:
        s = Steps.from_wire(msg.steps)
        id_offsets = np.frombuffer(bytes(msg.id_offsets), _I32)
    except ValueError as exc:
        raise BadBatch([FieldError(None, "steps", f"malformed columns: {exc}")]) from None
    events = msg.events
    step_at, event_at = _positions(s.seq, [e.seq for e in events])
    head: list[FieldError] = []  # as decode_batch orders them: NUL, versions, size, then by event
    if b"\\u0000" in _json.encode((msg.source, events)):  # msgpack text may hold NUL; PostgreSQL's not
        nul = nul_fields({"source": msgspec.to_builtins(msg.source), "events": msgspec.to_builtins(events)})
        head += [FieldError(None if e.index is None else event_at(e.index), e.field, e.reason) for e in nul]
    if msg.schema_version > ev.SCHEMA_VERSION:
        head.append(
            FieldError(None, "schema_version", f"{msg.schema_version} is newer than {ev.SCHEMA_VERSION}")
        )
    if s.n + len(events) > max_events:
        head.append(FieldError(None, "events", f"{s.n + len(events)} events, at most {max_events} per batch"))
    data = bytes(msg.ids)
    layout, bad_ids = id_errors(data, id_offsets)
    head += layout
    errors: list[FieldError] = []
    if not steps_ok(s):
        errors = step_errors(s, step_at) or [FieldError(None, "steps", "the columns break the contract")]
    errors += event_errors(msg.source, events, event_at)
    errors += _seq_clashes(s.seq, events, event_at)
    # keys and offsets that hold: a bad id is named where a step first names it, else by its key
    keys_hold = not layout and not any(e.index is None for e in errors)
    if keys_hold:
        key_errors = _key_errors(s, len(id_offsets) - 1)
        head += key_errors
        keys_hold = not key_errors
    if keys_hold:
        errors += _named_ids(s, bad_ids, step_at)
    else:
        errors += [FieldError(None, f"ids[{j}]", reason) for j, reason in bad_ids]
    errors = head + sorted(errors, key=lambda e: -1 if e.index is None else e.index)
    if errors:
        raise BadBatch(errors[:_MAX_ERRORS])
    return Columns(msg.source, s, events, data, id_offsets, msg.schema_version)


def _seq_clashes(
    step_seqs: np.ndarray, events: list[ev.Event], event_at: Callable[[int], int]
) -> list[FieldError]:
    """A seq given to a step and to another event: named at the event (seqs must increase)."""
    if not events or not len(step_seqs):
        return []
    seqs = np.fromiter((e.seq for e in events), np.int64, len(events))
    clash = np.isin(seqs, step_seqs)
    if not clash.any():
        return []
    j = _first(clash)
    return [
        FieldError(event_at(j), "seq", f"must increase within a batch: {int(seqs[j])} is a step's seq too")
    ]


def _key_errors(s: Steps, n: int) -> list[FieldError]:
    """Every key must be one of the message's ``n`` ids (not negative: ``steps_ok``)."""
    errors = []
    for name in ("request_keys", "stalled_keys"):
        k = s.values[name]
        if len(k) and k.max() >= n:
            j = _first(k >= n)
            errors.append(FieldError(None, f"steps.{name}[{j}]", f"key {int(k[j])} is not one of {n} ids"))
    return errors


def _named_ids(s: Steps, bad: list[tuple[int, str]], step_at: Callable[[int], int]) -> list[FieldError]:
    """Each bad id named where a step first names it (``request_ids[j]`` before ``stalled_request_ids``
    in a step, as ``decode_batch`` checks them); an id no step names, as ``ids[key]``."""
    errors = []
    for key, reason in bad:
        found: list[tuple[int, int, str]] = []
        for order, name in enumerate(("request_keys", "stalled_keys")):
            hits = np.flatnonzero(s.values[name] == key)
            if len(hits):
                r = int(hits[0])
                off = s.offsets(name)
                i = int(np.searchsorted(off, r, "right")) - 1
                found.append((i, order, f"{FIELD[name]}[{r - int(off[i])}]"))
        if found:
            i, _, field = min(found)
            errors.append(FieldError(step_at(i), field, reason))
        else:
            errors.append(FieldError(None, f"ids[{key}]", reason))
    return errors
