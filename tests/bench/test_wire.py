"""bench.wire: every candidate wire carries every row of the source exactly (a lost, reordered or
altered row fails), its fold is the ledger's fold, and a columnar message's 422 names the field as the
JSON one does."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np
import pytest

from bench import wire
from engine_hooks import events as ev
from ledger.fold import SUM_COLUMNS, fold_into
from ledger.validation import BadBatch, decode_batch

SIZES = (4, 7)  # steps a message (7: messages that do not divide the run)


@pytest.fixture(scope="module")
def traffic() -> wire.Traffic:
    return wire.small_traffic(seed=3)


def _references(traffic: wire.Traffic, n: int) -> list[list[ev.Event]]:
    out, seq = [], traffic.seq_start
    for m in traffic.all_messages(n):
        events, seq = wire.reference_events(m, seq)
        out.append(events)
    return out


def test_the_traffic_holds_every_kind_the_engine_sends(traffic):
    events = [e for refs in _references(traffic, 4) for e in refs]
    kinds = {type(e).__name__ for e in events}
    assert kinds == {"Queued", "Chunk", "Finished", "Preempted", "Resumed", "CutoffApplied", "Step"}
    steps = [e for e in events if type(e) is ev.Step]
    assert any(st.stalled_request_ids for st in steps)
    assert any(c > 1 for st in steps for c in st.token_counts)  # speculative decodes
    assert any(c == 0 for st in steps for c in st.token_counts)  # partial prefills
    assert all(len(r) == wire.ID_LEN for st in steps for r in st.request_ids)
    assert sum(traffic.rows) == sum(len(st.request_ids) for st in steps[-len(traffic.rows) :])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", [c.name for c in wire.candidates()])
def test_every_candidate_decodes_to_the_source_exactly(traffic, name, n):
    cand = next(c for c in wire.candidates() if c.name == name)
    encode, decode = cand.new_encoder(traffic.source, traffic.seq_start), cand.new_decoder()
    for entries, ref in zip(traffic.all_messages(n), _references(traffic, n), strict=True):
        got = decode(encode(entries))
        assert wire.canonical_columns(got) == wire.canonical(ref)


def test_the_comparison_sees_a_reordered_row(traffic):
    cand = next(c for c in wire.candidates() if c.name == "msgpack-all")
    entries, ref = traffic.all_messages(4)[3], _references(traffic, 4)[3]
    got = cand.new_decoder()(cand.new_encoder(traffic.source, traffic.seq_start)(entries))
    keys = got.steps.values["request_keys"].copy()
    keys[[0, 1]] = keys[[1, 0]]
    got.steps.values["request_keys"] = keys
    assert keys[0] != keys[1] and wire.canonical_columns(got) != wire.canonical(ref)


def _same_rows(got: dict[str, dict[str, Any]], want: dict[str, dict[str, Any]]) -> None:
    assert got.keys() == want.keys()
    for rid, row in want.items():
        assert got[rid].keys() == row.keys(), rid
        for col, v in row.items():
            if col in SUM_COLUMNS and isinstance(v, float):  # sums of floats: another order
                assert got[rid][col] == pytest.approx(v, rel=1e-12), (rid, col)
            else:
                assert got[rid][col] == v, (rid, col)


@pytest.mark.parametrize("method", list(wire.FOLDS))
@pytest.mark.parametrize("name", ["arrow-all", "arrow-new", "msgpack-all", "msgpack-new", "json"])
def test_the_fold_over_columns_is_the_ledgers_fold(traffic, name, method):
    cand = next(c for c in wire.candidates() if c.name == name)
    encode, decode = cand.new_encoder(traffic.source, traffic.seq_start), cand.new_decoder()
    for entries, ref in zip(traffic.all_messages(7), _references(traffic, 7), strict=True):
        folded = wire.fold_columns(decode(encode(entries)), method)
        want: dict[str, dict[str, Any]] = {}
        fold_into(want, traffic.source, ref)
        _same_rows(folded.as_rows(), want)
        assert int(folded.tokens.sum()) == sum(sum(e.token_counts) for e in ref if type(e) is ev.Step)


def _bad_message(traffic: wire.Traffic, change) -> tuple[list[wire.Entry], list[ev.Event]]:
    """The 6th message of 4 steps with its 3rd step changed by ``change(values) -> values``."""
    entries = list(traffic.all_messages(4)[5])
    at = [i for i, (layout, _) in enumerate(entries) if layout.kind is ev.Step][2]
    layout, values = entries[at]
    entries[at] = (layout, change(list(values)))
    seq = traffic.seq_start + sum(len(r) for r in _references(traffic, 4)[:5])
    return entries, wire.reference_events(entries, seq)[0]


def _with(field: str, fn):
    i = wire.L_STEP.fields.index(field)

    def change(values):
        values[i] = fn(values[i])
        return values

    return change


def _list_set(j: int, v):
    return lambda xs: [v if k == j else x for k, x in enumerate(xs)]


@pytest.mark.parametrize(
    "change",
    [
        _with("token_totals", _list_set(1, 0)),  # a total below its count
        _with("token_counts", _list_set(2, -1)),  # a negative count
        _with("ts", lambda _: -1.0),
        _with("kv_usage", lambda _: 1.5),
        _with("token_ids", lambda xs: xs[:-1]),  # an id missing
        _with("stalled_kv_blocks", lambda xs: [*xs, 3]),  # a block count without its request
    ],
    ids=["totals", "counts", "ts", "kv_usage", "token_ids", "stalled"],
)
@pytest.mark.parametrize("arrow", [False, True], ids=["msgpack", "arrow"])
def test_a_bad_step_is_refused_whole_naming_the_field_as_json_does(traffic, change, arrow):
    entries, events = _bad_message(traffic, change)
    with pytest.raises(BadBatch) as json_err:
        decode_batch(
            ev.batch_encoder.encode(ev.Batch(source=traffic.source, events=events)), max_events=10**6
        )
    body = wire.ColumnarEncoder(traffic.source, events[0].seq, wire.MessageKeys(), arrow, check=False)(
        entries
    )
    with pytest.raises(BadBatch) as col_err:
        wire.ColumnarDecoder(arrow, wire.MessageBook())(body)
    want, got = json_err.value.errors[0], col_err.value.errors[0]
    assert (got.index, got.field) == (want.index, want.field)
    with pytest.raises(ValueError):  # and the exporter would not have sent it
        wire.ColumnarEncoder(traffic.source, events[0].seq, wire.MessageKeys(), arrow)(entries)


def test_a_bad_request_id_is_named_as_json_names_it(traffic):
    entries, events = _bad_message(traffic, _with("request_ids", _list_set(0, "a/b")))
    with pytest.raises(BadBatch) as json_err:
        decode_batch(
            ev.batch_encoder.encode(ev.Batch(source=traffic.source, events=events)), max_events=10**6
        )
    body = wire.ColumnarEncoder(traffic.source, events[0].seq, wire.MessageKeys(), False, check=False)(
        entries
    )
    with pytest.raises(BadBatch) as err:
        wire.ColumnarDecoder(False, wire.MessageBook())(body)
    (e,) = err.value.errors
    want = json_err.value.errors[0]
    assert (e.index, e.field) == (want.index, want.field) and "'a/b'" in e.reason


def test_a_key_the_ledger_does_not_know_is_refused(traffic):
    """-new: a message that names a key whose id the ledger never got (a book lost, a message
    skipped) is refused, not folded under another request."""
    msgs = traffic.all_messages(4)
    encode = wire.ColumnarEncoder(traffic.source, traffic.seq_start, wire.SourceKeys(1), False)
    first, second = encode(msgs[0]), encode(msgs[1])
    decode = wire.ColumnarDecoder(False, wire.SourceBook())
    decode(first)
    fresh = wire.ColumnarDecoder(False, wire.SourceBook())
    with pytest.raises(BadBatch) as err:
        fresh(second)
    assert err.value.errors[0].field == "key_base"
    decode(second)  # in order: fine


def test_the_bench_runs_and_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "wire.json"
    args = ["--steps", "16", "--warmup", "8", "--running", "8", "--reps", "1", "--steps-per-message", "4,8"]
    wire.main([*args, "--no-imports", "--json", str(out)])
    figures = json.loads(out.read_text())
    names = {c.name for c in wire.candidates()}
    for size in ("4", "8"):
        assert set(figures["medians"][size]) == names
        for got in figures["medians"][size].values():
            assert {"encode", "bytes", "decode", "fold", "fold_method"} <= set(got)
            assert np.isfinite(got["fold"]) and got["bytes"] > 0
    assert "exporter encode" in capsys.readouterr().out
    assert msgspec.json.decode(out.read_bytes())["content_types"]["json"] == "application/json"
