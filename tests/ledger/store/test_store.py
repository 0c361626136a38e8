"""The storage write path on both backends (DuckDB file and real PostgreSQL)."""

from __future__ import annotations

import itertools
import random

import msgspec
import pytest

from engine_hooks import events as ev
from ledger.fold import AGGREGATES, fold
from ledger.schema import step_request_ids_sql
from ledger.store import open_store
from tests.support.factories import ENGINE, GATEWAY, batch, lifecycle, numbered


def test_store_accepts_new_events_and_counts_replays_as_duplicates(store):
    _, en = lifecycle("r1")
    b = batch(ENGINE, numbered(en))
    assert [(r.accepted, r.duplicates) for r in store.write([b])] == [(len(en), 0)]
    assert [(r.accepted, r.duplicates) for r in store.write([b])] == [(0, len(en))]
    assert store.count("events") == len(en)
    assert store.get_request("r1")["events"] == len(en)


def test_overlapping_retry_stores_only_the_new_tail(store):
    evs = numbered([ev.Queued(seq=0, ts=10.0 + i, request_id=f"r{i}", prompt_tokens=5) for i in range(10)])
    store.write([batch(ENGINE, evs[:6])])
    (res,) = store.write([batch(ENGINE, evs[3:])])
    assert (res.accepted, res.duplicates) == (4, 3)
    assert store.count("events") == 10
    assert store.source_rows()[0]["last_seq"] == 10
    assert store.source_rows()[0]["events_total"] == 10


def test_batch_overtaken_by_a_later_one_is_still_stored_once(store):
    evs = numbered([ev.Queued(seq=0, ts=10.0 + i, request_id=f"r{i}", prompt_tokens=5) for i in range(10)])
    store.write([batch(ENGINE, evs[5:])])  # the later batch lands first
    (res,) = store.write([batch(ENGINE, evs[:5])])
    assert (res.accepted, res.duplicates) == (5, 0)
    (res,) = store.write([batch(ENGINE, evs)])
    assert (res.accepted, res.duplicates) == (0, 10)
    assert store.count("events") == 10


def test_two_copies_of_a_batch_in_one_group_commit_store_once(store):
    evs = numbered([ev.Queued(seq=0, ts=10.0, request_id="a", prompt_tokens=5)])
    r1, r2 = store.write([batch(ENGINE, evs), batch(ENGINE, evs)])
    assert (r1.accepted, r2.accepted, r2.duplicates) == (1, 0, 1)
    assert store.get_request("a")["events"] == 1


def test_request_row_folds_gateway_and_engine_events(store):
    gw, en = lifecycle("r1")
    store.write([batch(GATEWAY, numbered(gw)), batch(ENGINE, numbered(en))])
    row = store.get_request("r1")
    assert row["gateway_source_id"] == "gw-0" and row["engine_source_id"] == "engine-0"
    assert row["model"] == "tiny-llama"
    assert row["prompt_tokens"] == 300
    # Token ledger: prompt = cached + computed on the first pass; the recompute is separate.
    assert row["cached_tokens"] + row["prefill_computed_tokens"] == row["prompt_tokens"]
    assert (row["cached_tokens"], row["prefill_computed_tokens"], row["recomputed_tokens"]) == (44, 256, 128)
    assert row["chunks"] == 3 and row["preemptions"] == 1 and row["resumes"] == 1
    assert row["backend_wait_measured_s"] == pytest.approx(0.198)
    assert row["admission_wait_s"] == pytest.approx(0.1)
    assert row["first_token_ts"] == pytest.approx(1_700_000_000.55)
    assert row["output_tokens"] == 10 and row["finish_reason"] == "stop" and row["status_code"] == 200
    assert row["kv_blocks_max"] == 20


def test_any_split_and_order_of_batches_gives_the_same_row(db_url, tmp_path):
    """Events of one request arriving out of order, in any batching, from two sources."""
    gw, en = lifecycle("r1")
    gw, en = numbered(gw), numbered(en)
    expected = fold([(GATEWAY, e) for e in gw] + [(ENGINE, e) for e in en])["r1"]
    rng = random.Random(7)
    for trial in range(3):
        wipe = open_store(db_url)
        with wipe.engine.begin() as conn:
            for t in ("events", "steps", "request_rows", "request_parts", "sources"):
                conn.exec_driver_sql(f"DELETE FROM {t}")
        wipe.close()
        s = open_store(db_url)
        try:
            pieces = []
            for src, evs in ((GATEWAY, gw), (ENGINE, en)):
                cut = sorted(rng.sample(range(1, len(evs)), 2))
                pieces += [batch(src, evs[a:b]) for a, b in itertools.pairwise([0, *cut, len(evs)])]
            rng.shuffle(pieces)
            compact_after = rng.randrange(len(pieces))  # partial rows merged at some point (DuckDB)
            for i, p in enumerate(pieces):
                s.write([p])
                if i == compact_after:
                    s.compact(force=True)
            row = s.get_request("r1")
        finally:
            s.close()
        got = {k: v for k, v in row.items() if k in AGGREGATES and v not in (None, 0, 0.0)}
        want = {k: v for k, v in expected.items() if v not in (None, 0, 0.0)}
        assert got.keys() == want.keys(), trial
        for k, v in want.items():
            assert got[k] == (pytest.approx(v) if isinstance(v, float) else v), k


def test_steps_are_stored_with_their_participants(store):
    steps = numbered(
        [
            ev.Step(
                seq=0,
                ts=5.0,
                step=0,
                duration_s=0.012,
                prefill_tokens=128,
                decode_tokens=3,
                num_prefill_reqs=1,
                num_decode_reqs=3,
                running=4,
                waiting=2,
                kv_usage=0.25,
                request_ids=["a", "b", "c", "d"],
            ),
            ev.Step(seq=0, ts=5.1, step=1, duration_s=0.004, decode_tokens=4, num_decode_reqs=4, running=4),
        ]
    )
    store.write([batch(ENGINE, steps)])
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT step, duration_s, prefill_tokens, {step_request_ids_sql()}, kv_usage FROM steps "
            "ORDER BY step"
        ).all()
        kinds = conn.exec_driver_sql("SELECT kind, data FROM events ORDER BY seq").all()
    assert rows[0][:3] == (0, 0.012, 128) and list(rows[0][3]) == ["a", "b", "c", "d"]
    assert list(rows[1][3]) == [] and rows[0][4] == 0.25
    assert kinds == [("step", None), ("step", None)]  # identity in events, fields in steps


def test_step_participant_ids_with_quotes_backslashes_and_separators_round_trip(store):
    odd = ['a"b', "c\\d", "e,f", "{g}", "h i", "NULL", "\\", '"', "tab\tnew\nline", "é-ü"]
    steps = numbered(
        [
            ev.Step(seq=0, ts=5.0, step=0, duration_s=0.01, request_ids=odd, stalled_request_ids=odd[::-1]),
            ev.Step(seq=0, ts=5.1, step=1, duration_s=0.01, request_ids=[]),
        ]
    )
    store.write([batch(ENGINE, steps)])
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT {step_request_ids_sql()}, stalled_request_ids FROM steps ORDER BY step"
        ).all()
    assert list(rows[0][0]) == odd and list(rows[0][1]) == odd[::-1]
    assert list(rows[1][0]) == [] and list(rows[1][1] or []) == []
    assert store.get_request("NULL")["step_count"] == 1 and store.get_request('a"b')["stalled_steps"] == 1


def test_output_token_ids_are_not_persisted_unless_configured(db_url):
    for persist, expected in ((False, None), (True, [1, 2, 3])):
        tokens = ev.Tokens(seq=0, ts=5.0, request_id=f"a-{persist}", count=3, total=3, token_ids=[1, 2, 3])
        evs = numbered([tokens])
        s = open_store(db_url, persist_token_ids=persist)
        try:
            s.write([batch(ev.Source(id=f"e-{persist}", kind="engine"), evs)])
            (data,) = [
                msgspec.json.decode(r[0])
                for r in s.engine.connect()
                .exec_driver_sql(f"SELECT data FROM events WHERE source_id = 'e-{persist}'")
                .all()
            ]
        finally:
            s.close()
        assert data.get("token_ids") == expected


def test_dropped_markers_add_up_in_the_source_row(store):
    store.write([batch(ENGINE, numbered([ev.Dropped(seq=0, ts=5.0, count=40, reason="queue_full")]))])
    store.write(
        [batch(ENGINE, numbered([ev.Dropped(seq=0, ts=6.0, count=2, reason="spool_full")], start=10))]
    )
    (src,) = store.source_rows()
    assert src["dropped_total"] == 42 and src["last_seq"] == 10


def test_request_timeline_lists_events_of_both_sources_in_time_order(store):
    gw, en = lifecycle("r1", preempt=False)
    store.write([batch(ENGINE, numbered(en)), batch(GATEWAY, numbered(gw))])
    timeline = store.request_events("r1")
    assert [e["ts"] for e in timeline] == sorted(e["ts"] for e in timeline)
    assert [e["kind"] for e in timeline][:4] == ["arrived", "admission_enqueued", "admitted", "queued"]
    chunk = next(e for e in timeline if e["kind"] == "chunk")
    assert chunk["source_id"] == "engine-0" and chunk["tokens"] == 128 and chunk["cached_tokens"] == 44


def test_a_failed_transaction_stores_nothing_and_keeps_the_high_water_mark(store, monkeypatch):
    evs = numbered([ev.Queued(seq=0, ts=10.0 + i, request_id=f"r{i}", prompt_tokens=5) for i in range(4)])
    store.write([batch(ENGINE, evs[:2])])

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(store, "_save_sources", boom)
    with pytest.raises(RuntimeError):
        store.write([batch(ENGINE, evs[2:])])
    monkeypatch.undo()
    assert store.count("events") == 2
    (res,) = store.write([batch(ENGINE, evs)])
    assert (res.accepted, res.duplicates) == (2, 2)
    assert store.count("events") == 4


def test_opening_a_duckdb_store_pays_the_arrow_paths_imports_before_the_first_ingest(tmp_path):
    """DuckDB imports pandas on the first registered Arrow table; the first batch must not wait for it."""
    import subprocess
    import sys

    pytest.importorskip("pandas")
    code = (
        "import sys; from ledger.store import open_store; "
        f"s = open_store('duckdb:///{tmp_path / 'w.duckdb'}'); print('pandas' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "True"
