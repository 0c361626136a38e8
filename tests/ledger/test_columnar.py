"""ledger.columnar: a columnar message (engine_hooks.columnar) decodes to exactly the events the JSON
path sends, and a bad one is refused whole, naming (index, field) as ``decode_batch`` names them for
the same events sent as JSON."""

from __future__ import annotations

import struct
from itertools import pairwise
from typing import Any

import msgspec
import pytest

from bench import wire
from engine_hooks import columnar
from engine_hooks import events as ev
from ledger.columnar import Columns, decode_columns
from ledger.validation import BadBatch, FieldError, decode_batch

MAX = 10**6


@pytest.fixture(scope="module")
def traffic() -> wire.Traffic:
    return wire.small_traffic(seed=5)


def _steps_of(c: Columns) -> list[dict[str, Any]]:
    """Every step of the columns as the Step's fields (ids resolved, lists cut at their offsets)."""
    s = c.steps
    cols: dict[str, list[Any]] = {
        "seq": s.seq.tolist(),
        **{n: s.scalar(n).tolist() for n in columnar.SCALARS},
    }
    for name, column in zip(columnar.LISTS, columnar.COLUMNS, strict=True):
        values = s.values[column]
        flat = c.names(values) if name in columnar.ID_LISTS else values.tolist()
        cols[name] = [flat[a:b] for a, b in pairwise(s.offsets(column).tolist())]
    return [{n: cols[n][i] for n in cols} for i in range(s.n)]


@pytest.mark.parametrize("n", [1, 4, 7])
def test_a_round_trip_is_the_json_paths_events_exactly(traffic, n):
    encode = columnar.ColumnarEncoder(traffic.source, traffic.seq_start)
    seq = traffic.seq_start
    for entries in traffic.all_messages(n):
        want, seq = wire.reference_events(entries, seq)
        json_body = ev.batch_encoder.encode(ev.Batch(source=traffic.source, events=want))
        got = decode_columns(encode(entries), max_events=MAX)
        sent = decode_batch(json_body, max_events=MAX).events  # what JSON carries, decoded
        assert got.source == traffic.source
        assert got.events == [e for e in sent if type(e) is not ev.Step]
        assert _steps_of(got) == [msgspec.structs.asdict(e) for e in sent if type(e) is ev.Step]
        assert got.rows == sum(len(e.request_ids) for e in sent if type(e) is ev.Step)
        assert got.batch() == ev.Batch(source=traffic.source, events=sent)  # what the store takes
    assert encode.next_seq == seq


def test_an_empty_message_decodes():
    source = ev.Source(id="engine-0", kind="engine", model="m")
    got = decode_columns(columnar.ColumnarEncoder(source, 1)([]), max_events=MAX)
    assert got.steps.n == 0 and got.events == [] and got.ids == []


# --- refusals, named as decode_batch names them --------------------------------------------------------


def _both(traffic: wire.Traffic, entries: list[wire.Entry], seq: int) -> tuple[FieldError, list[FieldError]]:
    """(decode_batch's first error for the entries as JSON, the columnar decoder's errors)."""
    events, _ = wire.reference_events(entries, seq)
    with pytest.raises(BadBatch) as json_err:
        decode_batch(ev.batch_encoder.encode(ev.Batch(source=traffic.source, events=events)), max_events=MAX)
    body = columnar.ColumnarEncoder(traffic.source, seq)(entries)
    with pytest.raises(BadBatch) as col_err:
        decode_columns(body, max_events=MAX)
    return json_err.value.errors[0], col_err.value.errors


def _message(
    traffic: wire.Traffic, k: int = 5, kind: type[Any] | None = None
) -> tuple[list[wire.Entry], int]:
    """The k-th message of 4 steps (the first from it with an event of ``kind``), and its first seq."""
    msgs = traffic.all_messages(4)
    if kind is not None:
        k = next(j for j in range(k, len(msgs)) if any(layout.kind is kind for layout, _ in msgs[j]))
    seq = traffic.seq_start + sum(len(wire.reference_events(m, 0)[0]) for m in msgs[:k])
    return list(msgs[k]), seq


def _change_step(entries: list[wire.Entry], field: str, fn, which: int = 2) -> list[wire.Entry]:
    at = [i for i, (layout, _) in enumerate(entries) if layout.kind is ev.Step][which]
    layout, values = entries[at]
    values = list(values)
    i = layout.fields.index(field)
    values[i] = fn(values[i])
    entries[at] = (layout, tuple(values))
    return entries


def _set(j: int, v):
    return lambda xs: [v if k == j else x for k, x in enumerate(xs)]


STEP_FAULTS = {
    "totals": ("token_totals", _set(1, 0)),  # a total below its count
    "counts": ("token_counts", _set(2, -1)),  # a negative count
    "ts": ("ts", lambda _: -1.0),
    "kv_usage": ("kv_usage", lambda _: 1.5),
    "token_ids": ("token_ids", lambda xs: xs[:-1]),  # an id missing
    "stalled": ("stalled_kv_blocks", lambda xs: [*xs, 3]),  # a block count without its request
    "duration": ("duration_s", lambda _: -0.5),
    "running": ("running", lambda _: -1),
    "counts_short": ("token_counts", lambda xs: xs[:-1]),
    "a_request_id_with_a_slash": ("request_ids", _set(1, "a/b")),
    "a_request_id_with_nul": ("request_ids", _set(0, "a\x00b")),
    "a_request_id_not_nfc": ("request_ids", _set(3, "cafe\u0301")),
    "a_request_id_too_long": ("request_ids", _set(0, "x" * 257)),
    "an_empty_request_id": ("request_ids", _set(0, "")),
}


@pytest.mark.parametrize("fault", list(STEP_FAULTS))
def test_a_bad_step_is_refused_whole_naming_the_field_as_json_does(traffic, fault):
    entries, seq = _message(traffic)
    field, fn = STEP_FAULTS[fault]
    want, got = _both(traffic, _change_step(entries, field, fn), seq)
    assert (got[0].index, got[0].field) == (want.index, want.field), got


def test_a_bad_stalled_request_id_is_named_in_its_step(traffic):
    for k in range(len(traffic.all_messages(4))):  # a message with a stalled request
        entries, seq = _message(traffic, k)
        steps = [v for layout, v in entries if layout.kind is ev.Step]
        i = columnar.STEP_ORDER.index("stalled_request_ids")
        which = next((w for w, v in enumerate(steps) if v[i]), None)
        if which is not None:
            break
    assert which is not None
    entries = _change_step(entries, "stalled_request_ids", _set(0, "a/b"), which)
    want, got = _both(traffic, entries, seq)
    assert (
        (got[0].index, got[0].field) == (want.index, want.field) == (got[0].index, "stalled_request_ids[0]")
    )


@pytest.mark.parametrize("rid", ["a/b", "..", ".", "a\x00b", "cafe\u0301", "x" * 257, ""])
def test_a_bad_request_id_of_another_event_is_named_as_json_does(traffic, rid):
    entries, seq = _message(traffic, kind=ev.Queued)
    at = next(i for i, (layout, _) in enumerate(entries) if layout.kind is ev.Queued)
    layout, values = entries[at]
    entries[at] = (layout, (values[0], rid, *values[2:]))
    want, got = _both(traffic, entries, seq)
    assert (got[0].index, got[0].field) == (want.index, want.field), got


@pytest.mark.parametrize("rid", ["..", "."])
def test_a_dot_segment_in_a_step_is_refused(traffic, rid):
    """decode_batch checks a step's ids for dot segments only when the body holds a '/' (a scan); the
    columnar decoder checks every id it gets, once."""
    entries, seq = _message(traffic)
    body = columnar.ColumnarEncoder(traffic.source, seq)(_change_step(entries, "request_ids", _set(0, rid)))
    with pytest.raises(BadBatch) as err:
        decode_columns(body, max_events=MAX)
    events, _ = wire.reference_events(entries, seq)
    step_index = [i for i, e in enumerate(events) if type(e) is ev.Step][2]
    assert (err.value.errors[0].index, err.value.errors[0].field) == (step_index, "request_ids[0]")


def _encoded(traffic: wire.Traffic, **change: Any) -> bytes:
    entries, seq = _message(traffic)
    msg = columnar.ColumnarEncoder(traffic.source, seq).message(entries)
    return columnar.encoder.encode(msgspec.structs.replace(msg, **change))


def _refused(body: bytes, max_events: int = MAX) -> list[FieldError]:
    with pytest.raises(BadBatch) as err:
        decode_columns(body, max_events=max_events)
    return err.value.errors


def test_a_truncated_or_garbage_body_is_refused_naming_body(traffic):
    body = _encoded(traffic)
    for bad in (body[: len(body) // 2], body[:-1], b"", b"\xc1garbage", b"{}"):
        assert [e.field for e in _refused(bad)] == ["body"]
    assert _refused(msgspec.msgpack.encode({"source": 1}))[0].field == "source"
    deep = b"\x81\xa1x" * 100_000 + b"\xc0"  # {"x": {"x": ...}}: an unknown field nested deep
    assert [e.field for e in _refused(deep)] == ["body"]


def test_a_newer_wire_version_is_refused(traffic):
    (e,) = _refused(_encoded(traffic, wire_version=columnar.WIRE_VERSION + 1))
    assert (e.index, e.field) == (None, "wire_version") and "newer" in e.reason


def test_a_newer_wire_version_in_another_layout_is_refused_naming_wire_version():
    body = msgspec.msgpack.encode({"wire_version": columnar.WIRE_VERSION + 1, "steps": "elsewhere"})
    (e,) = _refused(body)
    assert (e.index, e.field) == (None, "wire_version")


def test_a_bad_id_is_named_beside_a_batch_level_error(traffic):
    entries, seq = _message(traffic)
    entries = _change_step(entries, "request_ids", _set(1, "a/b"))
    msg = columnar.ColumnarEncoder(traffic.source, seq).message(entries)
    body = columnar.encoder.encode(msgspec.structs.replace(msg, schema_version=ev.SCHEMA_VERSION + 1))
    assert [e.field for e in _refused(body)] == ["schema_version", "request_ids[1]"]


def test_a_newer_schema_version_and_too_many_events_are_refused_as_json_does(traffic):
    (e,) = _refused(_encoded(traffic, schema_version=ev.SCHEMA_VERSION + 1))
    assert (e.index, e.field) == (None, "schema_version")
    entries, seq = _message(traffic)
    n = len(wire.reference_events(entries, seq)[0])
    decode_columns(_encoded(traffic), max_events=n)
    (e,) = _refused(_encoded(traffic), max_events=n - 1)
    assert (e.index, e.field) == (None, "events") and f"{n} events" in e.reason


def test_seqs_must_increase_across_steps_and_other_events(traffic):
    entries, seq = _message(traffic)
    msg = columnar.ColumnarEncoder(traffic.source, seq).message(entries)
    events, _ = wire.reference_events(entries, seq)
    step_seq = next(e.seq for e in events if type(e) is ev.Step)
    # another event given a step's seq
    clash = [msgspec.structs.replace(msg.events[0], seq=step_seq), *msg.events[1:]]
    errors = _refused(columnar.encoder.encode(msgspec.structs.replace(msg, events=clash)))
    assert errors[0].field == "seq" and str(step_seq) in errors[0].reason
    # other events out of order
    swapped = [msg.events[1], msg.events[0], *msg.events[2:]]
    errors = _refused(columnar.encoder.encode(msgspec.structs.replace(msg, events=swapped)))
    assert [(e.index, e.field) for e in errors] == [(1, "seq")]
    # a step's seq lower than the step before it: refused naming seq, as JSON
    ev_seqs = {e.seq for e in events if type(e) is not ev.Step}
    steps = [e for e in events if type(e) is ev.Step]
    back = steps[1].seq - 1 if steps[1].seq - 1 not in ev_seqs else steps[0].seq
    want_events = [msgspec.structs.replace(e, seq=back) if e is steps[1] else e for e in events]
    with pytest.raises(BadBatch) as json_err:
        decode_batch(
            ev.batch_encoder.encode(ev.Batch(source=traffic.source, events=want_events)), max_events=MAX
        )
    data = bytearray(msg.steps.data)
    struct.pack_into("<q", data, 8, back)  # seq of step 1 (int64 block, seq column first)
    steps_field = columnar.PackedSteps(msg.steps.n, msg.steps.counts, memoryview(bytes(data)))
    errors = _refused(columnar.encoder.encode(msgspec.structs.replace(msg, steps=steps_field)))
    assert errors[0].field == json_err.value.errors[0].field == "seq"


def test_a_step_among_the_other_events_or_a_kind_the_source_cannot_send_is_refused(traffic):
    entries, seq = _message(traffic)
    msg = columnar.ColumnarEncoder(traffic.source, seq).message(entries)
    last = msg.events[-1].seq
    step = ev.Step(seq=last + 1000, ts=1.0, step=1, duration_s=0.1)
    errors = _refused(columnar.encoder.encode(msgspec.structs.replace(msg, events=[*msg.events, step])))
    assert errors[0].field == "kind"
    arrived = ev.EVENT_TYPES["arrived"]
    gateway_only = msgspec.convert(
        {"kind": "arrived", "seq": last + 1000, "ts": 1.0, "request_id": "r1"}, ev.Event
    )
    assert type(gateway_only) is arrived
    errors = _refused(
        columnar.encoder.encode(msgspec.structs.replace(msg, events=[*msg.events, gateway_only]))
    )
    assert errors[0].field == "kind" and errors[0].index == len(wire.reference_events(entries, seq)[0])


def test_an_event_that_does_not_decode_is_named_as_json_names_it(traffic):
    entries, seq = _message(traffic, kind=ev.Queued)
    at = next(i for i, (layout, _) in enumerate(entries) if layout.kind is ev.Queued)
    layout, values = entries[at]
    entries[at] = (layout, (values[0], values[1], -5, *values[3:]))  # prompt_tokens < 0
    events, _ = wire.reference_events(entries, seq)
    with pytest.raises(BadBatch) as json_err:
        decode_batch(ev.batch_encoder.encode(ev.Batch(source=traffic.source, events=events)), max_events=MAX)
    (got,) = _refused(columnar.ColumnarEncoder(traffic.source, seq)(entries))
    want = json_err.value.errors[0]
    assert (got.index, got.field) == (want.index, want.field) == (want.index, "prompt_tokens")


def test_nul_in_another_events_text_is_refused_as_json_does(traffic):
    entries, seq = _message(traffic, kind=ev.Finished)
    at = next(i for i, (layout, _) in enumerate(entries) if layout.kind is ev.Finished)
    layout, values = entries[at]
    i = layout.fields.index("stop_reason")
    entries[at] = (layout, (*values[:i], "a\x00", *values[i + 1 :]))
    want, got = _both(traffic, entries, seq)
    assert (got[0].index, got[0].field) == (want.index, want.field)
