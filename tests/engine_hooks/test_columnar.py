"""engine_hooks.columnar: the encoder of the columnar message, on its own (the ledger's side and the
round trip: tests/ledger/test_columnar.py)."""

from __future__ import annotations

import struct
import subprocess
import sys

import msgspec
import pytest

from engine_hooks import columnar
from engine_hooks import events as ev
from engine_hooks import fields as hook_fields
from engine_hooks.exporter.queue import Layout, make_builder

SOURCE = ev.Source(id="engine-0", kind="engine", model="m")
L_QUEUED = Layout(
    ev.Queued, hook_fields.QUEUED_FIELDS, make_builder(ev.Queued, hook_fields.QUEUED_FIELDS), False
)
L_STEP = Layout(ev.Step, hook_fields.STEP_FIELDS, make_builder(ev.Step, hook_fields.STEP_FIELDS), False)


def _step(k: int, ids: list[str], stalled: list[str], **change: object) -> tuple[object, ...]:
    values = {
        "ts": 1.75e9 + k,
        "step": k,
        "duration_s": 0.03,
        "prefill_tokens": 0,
        "decode_tokens": len(ids),
        "num_prefill_reqs": 0,
        "num_decode_reqs": len(ids),
        "running": len(ids),
        "waiting": 0,
        "kv_usage": 0.5,
        "request_ids": ids,
        "prefill_depth_tokens": 0,
        "max_prefill_depth": 0,
        "stalled_request_ids": stalled,
        "stalled_kv_blocks": [3] * len(stalled),
        "token_counts": [1] * len(ids),
        "token_totals": [k + 1] * len(ids),
        "token_ids": list(range(len(ids))),
        **change,
    }
    return tuple(values[n] for n in hook_fields.STEP_FIELDS)


def test_a_message_numbers_the_events_and_keys_the_ids_in_order_of_first_use():
    encode = columnar.ColumnarEncoder(SOURCE, 10)
    entries = [
        (L_QUEUED, (1.75e9, "c", 5, None, None, 0)),
        (L_STEP, _step(1, ["a", "b"], ["c"])),
        (L_STEP, _step(2, ["b", "c"], [])),
    ]
    msg = msgspec.msgpack.decode(encode(entries), type=columnar.Message)
    assert encode.next_seq == 13
    assert (msg.wire_version, msg.schema_version) == (columnar.WIRE_VERSION, ev.SCHEMA_VERSION)
    assert [type(e) for e in msg.events] == [ev.Queued] and msg.events[0].seq == 10
    assert bytes(msg.ids) == b"abc"
    assert struct.unpack("<4i", msg.id_offsets) == (0, 1, 2, 3)
    n = msg.steps.n
    assert n == 2 and msg.steps.counts == [4, 1, 1, 4, 4, 4]
    data = bytes(msg.steps.data)
    assert struct.unpack_from("<2q", data) == (11, 12)  # the steps' seqs
    i32 = struct.unpack_from(f"<{(len(data) - 48 * n) // 4}i", data, 48 * n)
    offsets = i32[7 * n : 7 * n + 6 * (n + 1)]
    assert offsets[: 2 * (n + 1)] == (0, 2, 4, 0, 1, 1)  # request keys, stalled keys
    assert i32[7 * n + 6 * (n + 1) :][:5] == (0, 1, 1, 2, 2)  # keys a b | b c, then stalled c


def test_a_number_outside_its_column_type_is_not_packed():
    encode = columnar.ColumnarEncoder(SOURCE, 1)
    with pytest.raises(struct.error):
        encode([(L_STEP, _step(1, ["a"], [], running=2**31))])


def test_the_encoder_loads_no_numpy_and_no_ledger():
    code = (
        "import sys, engine_hooks.columnar; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('numpy', 'ledger', 'pyarrow')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_media_type():
    assert columnar.MEDIA_TYPE == "application/vnd.chunkledger.columns+msgpack"


def test_a_batch_encoded_as_columns_decodes_back_to_the_same_events():
    from bench import wire

    traffic = wire.small_traffic(seed=3)
    seq = traffic.seq_start
    for entries in traffic.all_messages(4):
        events, seq = wire.reference_events(entries, seq)
        batch = ev.Batch(source=traffic.source, events=events)
        assert columnar.decode_to_batch(columnar.encode_batch(batch)) == batch


def test_a_body_that_is_not_a_message_does_not_decode_back():
    with pytest.raises((msgspec.DecodeError, ValueError)):
        columnar.decode_to_batch(b"\x00garbage")


def test_spooled_json_batches_merge_and_a_columnar_message_is_replayed_alone():
    from engine_hooks.exporter import merge_records
    from engine_hooks.spool import SpoolRecord

    source = ev.Source(id="engine-0", kind="engine", model="m")

    def batch(seq: int) -> ev.Batch:
        return ev.Batch(
            source=source, events=[ev.Queued(seq=seq, ts=1.0, request_id=f"r{seq}", prompt_tokens=1)]
        )

    as_json = [SpoolRecord(ev.batch_encoder.encode(batch(s)), 1) for s in (1, 2)]
    as_columns = SpoolRecord(columnar.encode_batch(batch(3)), 1)
    body, used, events = merge_records([*as_json, as_columns, *as_json])
    assert (used, events) == (2, 2) and ev.batch_decoder.decode(body).events == [
        *batch(1).events,
        *batch(2).events,
    ]
    assert merge_records([as_columns, *as_json]) == (as_columns.payload, 1, 1)
    assert columnar.is_message(as_columns.payload) and not columnar.is_message(as_json[0].payload)
