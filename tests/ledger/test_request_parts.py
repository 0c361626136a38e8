"""Partial request rows (request_parts) and their compaction into request_rows, on both backends.

DuckDB appends each group's partial rows and compacts them later; PostgreSQL merges directly. Either
way the ``requests`` view must show the fold of every committed event, before and after compaction.
"""

from __future__ import annotations

import asyncio
import importlib
import time

import pytest
import sqlalchemy as sa

from engine_hooks import events as ev
from ledger import migrate
from ledger.fold import AGGREGATES, fold
from ledger.ingest import IngestWriter
from ledger.store import make_engine, open_store
from tests.support.factories import ENGINE, GATEWAY, batch, lifecycle, numbered

_v6 = importlib.import_module("migrations.versions.0006_client_side")


def _rows(store, ids):
    return {rid: {k: v for k, v in store.get_request(rid).items() if k in AGGREGATES} for rid in ids}


def _write_in_pieces(store, rids):
    """Each request's events split over three groups, gateway and engine interleaved."""
    evs = {rid: lifecycle(rid, t0=1_700_000_000.0 + i) for i, rid in enumerate(rids)}
    gw = numbered([e for rid in rids for e in evs[rid][0]])
    en = numbered([e for rid in rids for e in evs[rid][1]])
    for k in range(3):
        store.write([batch(GATEWAY, gw[k::3]), batch(ENGINE, en[k::3])])
    return fold([(GATEWAY, e) for e in gw] + [(ENGINE, e) for e in en])


def _assert_matches_fold(rows, expected):
    for rid, want in expected.items():
        got = rows[rid]
        for col, v in want.items():
            assert got[col] == (pytest.approx(v) if isinstance(v, float) else v), (rid, col)


def test_view_shows_the_full_fold_before_and_after_compaction(store):
    rids = ["a", "b", "c"]
    expected = _write_in_pieces(store, rids)
    before = _rows(store, rids)
    _assert_matches_fold(before, expected)
    store.compact(force=True)
    assert store.count("request_parts") == 0
    assert _rows(store, rids) == before
    with store.engine.connect() as conn:
        merged = conn.exec_driver_sql("SELECT request_id, events FROM request_rows ORDER BY request_id").all()
    assert [(r, n) for r, n in merged] == [(rid, before[rid]["events"]) for rid in rids]


def test_duckdb_appends_partial_rows_one_per_group_and_compaction_merges_them(tmp_path):
    store = open_store(f"duckdb:///{tmp_path / 'l.duckdb'}")
    try:
        _write_in_pieces(store, ["a", "b"])
        # Three groups, each naming both requests: six partial rows, nothing merged yet.
        assert store.count("request_parts") == 6
        assert store.count("request_rows") == 0
        assert store.compact() == 0  # not due: few rows, young
        assert store.compact(force=True) == 6
        assert (store.count("request_parts"), store.count("request_rows")) == (0, 2)
        # Later events of a compacted request merge with its compacted row.
        store.write(
            [batch(ENGINE, numbered([ev.Tokens(seq=0, ts=1.8e9, request_id="a", count=5, total=15)], 100))]
        )
        assert store.get_request("a")["output_tokens"] == 15
        assert store.get_request("a")["token_events"] == 3
    finally:
        store.close()


def test_duckdb_compaction_is_due_when_enough_rows_wait_or_the_oldest_waited_long_enough(tmp_path):
    store = open_store(f"duckdb:///{tmp_path / 'l.duckdb'}")
    try:
        store.compact_interval_s = 3600.0
        _write_in_pieces(store, ["a", "b"])
        assert not store.compact_due() and store.compact() == 0
        store.compact_rows = 7
        store.write(
            [batch(ENGINE, numbered([ev.Queued(seq=0, ts=1.0, request_id="z", prompt_tokens=3)], 500))]
        )
        assert store.compact_due() and store.compact() == 7
        assert (store.count("request_parts"), store.count("request_rows")) == (0, 3)
        store.compact_rows, store.compact_interval_s = 1_000, 0.2
        store.write(
            [batch(ENGINE, numbered([ev.Queued(seq=0, ts=1.0, request_id="y", prompt_tokens=3)], 600))]
        )
        assert not store.compact_due()
        time.sleep(0.25)
        assert store.compact_due() and store.compact() == 1
    finally:
        store.close()


def test_duckdb_compacts_a_busy_fleet_on_the_clock_not_every_few_groups(tmp_path):
    """Each compaction has a fixed cost; compacting every 20k rows took 15-24 % of a fleet's ingest."""
    store = open_store(f"duckdb:///{tmp_path / 'l.duckdb'}")
    try:
        store.compact_interval_s = 3600.0
        seq = 1
        for g in range(12):  # 12 groups of 3,000 requests: 36k partial rows
            evs = [
                ev.Tokens(seq=0, ts=2.0 + g, request_id=f"r{i}", count=1, total=g + 1) for i in range(3000)
            ]
            store.write([batch(ENGINE, numbered(evs, seq))])
            seq += len(evs)
            assert store.compact() == 0
        assert store.count("request_parts") == 36_000
        store.compact_interval_s = 0.0
        assert store.compact() == 36_000
        assert store.get_request("r7")["token_events"] == 12
    finally:
        store.close()


def test_view_keeps_the_column_types_while_parts_wait(tmp_path):
    """sum() widens integers (HUGEINT on DuckDB): the merged view must still give request_rows' types."""
    store = open_store(f"duckdb:///{tmp_path / 'l.duckdb'}")
    try:
        _write_in_pieces(store, ["a"])
        assert store.count("request_parts") > 0
        with store.engine.connect() as conn:
            types = dict(
                conn.exec_driver_sql("SELECT column_name, column_type FROM (DESCRIBE requests)").all()
            )
            base = dict(
                conn.exec_driver_sql("SELECT column_name, column_type FROM (DESCRIBE request_rows)").all()
            )
        assert {c: types[c] for c in base} == base
    finally:
        store.close()


def test_uncompacted_parts_survive_a_crash_and_are_compacted_after_restart(tmp_path):
    url = f"duckdb:///{tmp_path / 'l.duckdb'}"
    store = open_store(url)
    expected = _write_in_pieces(store, ["a", "b"])
    store.close(compact=False)  # what a kill leaves: committed parts not compacted
    again = open_store(url)
    try:
        assert again.count("request_parts") == 6
        _assert_matches_fold(_rows(again, ["a", "b"]), expected)
        again.compact_interval_s = 0.0
        assert again.compact() == 6
        _assert_matches_fold(_rows(again, ["a", "b"]), expected)
    finally:
        again.close()


def test_clean_close_leaves_no_partial_rows(tmp_path):
    url = f"duckdb:///{tmp_path / 'l.duckdb'}"
    store = open_store(url)
    _write_in_pieces(store, ["a"])
    store.close()
    again = open_store(url)
    try:
        assert (again.count("request_parts"), again.count("request_rows")) == (0, 1)
    finally:
        again.close()


def _submit(writer, b):
    return asyncio.run(writer.submit(b))


def test_the_ingest_writer_compacts_after_a_group_once_due_and_when_idle(tmp_path):
    store = open_store(f"duckdb:///{tmp_path / 'l.duckdb'}")
    store.compact_rows = 2
    writer = IngestWriter(store)
    writer.start()
    try:
        two = [ev.Queued(seq=0, ts=1.0, request_id=r, prompt_tokens=3) for r in ("p", "q")]
        _submit(writer, batch(ENGINE, numbered(two)))
        deadline = time.monotonic() + 5
        while store.count("request_parts") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (store.count("request_parts"), store.count("request_rows")) == (0, 2)
        store.compact_rows, store.compact_interval_s = 1_000, 0.2
        one = [ev.Queued(seq=0, ts=1.0, request_id="r", prompt_tokens=3)]
        _submit(writer, batch(ENGINE, numbered(one, 10)))
        assert store.count("request_parts") == 1  # not due yet
        deadline = time.monotonic() + 5  # no more groups: the idle writer compacts it
        while store.count("request_parts") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (store.count("request_parts"), store.count("request_rows")) == (0, 3)
        assert store.get_request("r")["prompt_tokens"] == 3
    finally:
        writer.stop()
        store.close()


def test_compacting_between_groups_loses_and_doubles_nothing(tmp_path):
    store = open_store(f"duckdb:///{tmp_path / 'l.duckdb'}")
    store.compact_interval_s = 0.0  # due after every group, as under a steady load
    try:
        seq = 1
        for g in range(60):
            evs = [
                ev.Tokens(seq=0, ts=2.0 + g, request_id=f"r{(g * 7 + i) % 40}", count=1, total=g + 1)
                for i in range(50)
            ]
            store.write([batch(ENGINE, numbered(evs, seq))])
            seq += len(evs)
            if g % 3 == 0:
                assert store.compact() > 0
        with store.engine.connect() as conn:
            total = conn.exec_driver_sql("SELECT sum(token_events), count(*) FROM requests").one()
        assert tuple(total) == (60 * 50, 40)
        store.compact(force=True)
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT sum(token_events) FROM request_rows").scalar_one() == 3000
    finally:
        store.close()


def test_downgrade_below_parts_folds_them_into_request_rows(db_url):
    store = open_store(db_url)
    expected = _write_in_pieces(store, ["a", "b"])
    if store.dialect == "duckdb":
        assert store.count("request_parts") == 6
        store.close(compact=False)  # leave the parts for the downgrade
    else:
        store.close()
    engine = make_engine(db_url)
    try:
        migrate.downgrade(engine, "0003")
        with engine.connect() as conn:
            assert "request_parts" not in set(sa.inspect(conn).get_table_names())
            rows = conn.exec_driver_sql("SELECT * FROM requests WHERE request_id IN ('a', 'b')").all()
        added_later = set(_v6._NEW)  # migration 0006's columns: dropped by the downgrade
        below = {
            rid: {c: v for c, v in want.items() if c not in added_later} for rid, want in expected.items()
        }
        _assert_matches_fold({r._mapping["request_id"]: dict(r._mapping) for r in rows}, below)
        migrate.upgrade(engine)
    finally:
        engine.dispose()


def test_duckdb_checkpoints_the_wal_at_64_mb_instead_of_16(tmp_path):
    store = open_store(f"duckdb:///{tmp_path / 'l.duckdb'}")
    try:
        with store.engine.connect() as conn:
            setting = conn.exec_driver_sql("SELECT current_setting('checkpoint_threshold')").scalar_one()
        assert setting == "61.0 MiB"  # DuckDB prints 64 MB (decimal) in MiB
    finally:
        store.close()


def test_integer_sums_saturate_instead_of_breaking_the_view_the_merge_or_compaction(store):
    # A row already near 2^63 - 1 (the contract bounds each event's counts; rows stored before those
    # bounds need not be): a later batch must neither fail the write nor make reads fail for good.
    near = ev.INT64_MAX - 5
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO request_rows (request_id, cached_tokens, chunks, events) "
            f"VALUES ('sat', {near}, 1, 1)"
        )
    chunk = ev.Chunk(seq=1, ts=5.0, request_id="sat", step=1, tokens=4, computed_before=0, cached_tokens=10)
    store.write([batch(ENGINE, [chunk])])
    row = store.get_request("sat")
    assert (row["cached_tokens"], row["chunks"], row["prefill_computed_tokens"]) == (ev.INT64_MAX, 2, 4)
    store.compact(force=True)
    assert store.get_request("sat")["cached_tokens"] == ev.INT64_MAX
    assert store.count("request_parts") == 0


def _columnar_groups(store, n_groups=3):
    """A small run with every kind in it, as columnar messages, stored a few messages a group."""
    from engine_hooks import columnar
    from ledger.columnar import decode_columns
    from tests.ledger.api.test_ingest_wires import _batches

    messages = [decode_columns(columnar.encode_batch(b), max_events=10_000) for b in _batches()]
    size = -(-len(messages) // n_groups)
    for i in range(0, len(messages), size):
        group = messages[i : i + size]
        store.write([m.batch() for m in group], None, group)
    return [m.batch() for m in messages]


def _all_rows(store_or_engine):
    engine = getattr(store_or_engine, "engine", store_or_engine)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT * FROM requests ORDER BY request_id").mappings().all()
    return [{k: v for k, v in r.items() if k in AGGREGATES or k == "request_id"} for r in rows]


def test_duckdb_appends_a_groups_steps_to_the_narrow_step_parts_and_the_view_and_compaction_merge_them(
    tmp_path,
):
    """Steps set ten columns: their partial rows go to request_step_parts (the rest of request_rows'
    53 columns, NULLs and zeros, were most of DuckDB's WAL); the rows read the same as the fold."""
    store = open_store(f"duckdb:///{tmp_path / 'l.duckdb'}")
    try:
        sent = _columnar_groups(store)
        assert store.count("request_step_parts") > 0
        with store.engine.connect() as conn:
            cols = [
                c[0]
                for c in conn.exec_driver_sql("SELECT * FROM request_step_parts LIMIT 0").cursor.description
            ]
        assert len(cols) == 11
        before = _all_rows(store)
        expected = fold([(b.source, e) for b in sent for e in b.events])
        _assert_matches_fold({r["request_id"]: r for r in before}, expected)
        merged = store.compact(force=True)
        assert merged > 0 and store.count("request_step_parts") == store.count("request_parts") == 0
        assert _all_rows(store) == before
    finally:
        store.close()


def test_downgrade_below_step_parts_moves_them_to_request_parts(tmp_path):
    url = f"duckdb:///{tmp_path / 'l.duckdb'}"
    store = open_store(url)
    _columnar_groups(store)
    before = _all_rows(store)
    assert store.count("request_step_parts") > 0
    store.close(compact=False)
    engine = make_engine(url)
    try:
        migrate.downgrade(engine, "0009")
        with engine.connect() as conn:
            assert "request_step_parts" not in set(sa.inspect(conn).get_table_names())
        down = _all_rows(engine)
        # the same rows, in the columns that revision has (later ones add columns: 0011's trace ids)
        assert down and down == [{k: r[k] for k in down[0]} for r in before]
        migrate.upgrade(engine)
        assert _all_rows(engine) == before
    finally:
        engine.dispose()
