"""Steps store their requests as integer keys (``request_keys``): one key per request, whatever the
group, the writer, its cache or a failed transaction; old databases migrate with their steps intact."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from engine_hooks import events as ev
from ledger import migrate
from ledger.schema import step_request_ids_sql
from ledger.store import make_engine, open_store
from ledger.store.request_keys import KeyCache, keys_for
from tests.support.factories import ENGINE, batch, numbered


def _step(step: int, ids: list[str], ts: float | None = None) -> ev.Step:
    return ev.Step(
        seq=0, ts=ts if ts is not None else 100.0 + step, step=step, duration_s=0.01, request_ids=ids
    )


def _stored(store) -> list[tuple[int, list[int], list[str]]]:
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"SELECT step, request_keys, {step_request_ids_sql()} FROM steps ORDER BY step"
        ).all()
    return [(step, list(keys), list(ids)) for step, keys, ids in rows]


def _key_table(store) -> dict[str, int]:
    with store.engine.connect() as conn:
        return dict(conn.exec_driver_sql("SELECT request_id, request_key FROM request_keys").all())


def test_a_request_keeps_one_key_across_groups_and_restarts(db_url):
    store = open_store(db_url)
    evs = numbered([_step(0, ["a", "b"]), _step(1, ["b", "c"]), _step(2, ["c", "a", "d"])])
    store.write([batch(ENGINE, evs[:1])])
    store.write([batch(ENGINE, evs[1:2])])
    store.close()
    store = open_store(db_url)  # a new writer: an empty cache, the keys come from the table
    (res,) = store.write([batch(ENGINE, evs[2:])])
    assert (res.accepted, res.duplicates) == (1, 0)
    rows = _stored(store)
    keys = _key_table(store)
    store.close()
    assert [ids for _, _, ids in rows] == [["a", "b"], ["b", "c"], ["c", "a", "d"]]
    assert [k for _, k, _ in rows] == [[keys[r] for r in ids] for _, _, ids in rows]
    assert len(set(keys.values())) == 4  # one key per request
    assert keys["a"] < keys["c"] < keys["d"]  # drawn in order of first appearance


def test_a_group_that_rolls_back_leaves_no_key_behind(db_url, monkeypatch):
    store = open_store(db_url)
    evs = numbered([_step(0, ["x", "y"]), _step(1, ["x", "z"])])

    def broken(conn, prepared):
        raise RuntimeError("disk full")

    with monkeypatch.context() as m:
        m.setattr(store, "_append", broken)
        with pytest.raises(RuntimeError):
            store.write([batch(ENGINE, evs[:1])])
    assert len(store._keys) == 0 and _key_table(store) == {}
    store.write([batch(ENGINE, evs)])
    rows = _stored(store)
    store.close()
    assert [ids for _, _, ids in rows] == [["x", "y"], ["x", "z"]]


def test_ids_the_cache_let_go_of_are_found_again_with_their_keys(db_url):
    store = open_store(db_url)
    store._keys = KeyCache(size=2)  # two generations of two ids: most ids fall out between groups
    named = [[f"r{(i + j) % 7}" for j in range(3)] for i in range(12)]
    evs = numbered([_step(i, ids) for i, ids in enumerate(named)])
    for e in evs:
        store.write([batch(ENGINE, [e])])
    rows = _stored(store)
    keys = _key_table(store)
    store.close()
    assert [ids for _, _, ids in rows] == named
    assert len(keys) == 7 and len(set(keys.values())) == 7
    assert [k for _, k, _ in rows] == [[keys[r] for r in ids] for ids in named]


def test_two_writers_naming_the_same_requests_share_their_keys(db_url):
    if not db_url.startswith("postgresql"):
        pytest.skip("replicas write to PostgreSQL; a DuckDB file has one writer")
    one, two = open_store(db_url), open_store(db_url)
    a = ev.Source(id="engine-a", kind="engine")
    one.write([batch(a, numbered([_step(0, ["p", "q"])]))])
    two.write([batch(a, numbered([_step(1, ["q", "p", "s"])], 2))])  # its next batch, to the other
    keys = _key_table(one)
    with one.engine.connect() as conn:
        rows = conn.exec_driver_sql(f"SELECT step, {step_request_ids_sql()} FROM steps ORDER BY step").all()
    one.close()
    two.close()
    assert [(step, list(ids)) for step, ids in rows] == [(0, ["p", "q"]), (1, ["q", "p", "s"])]
    assert sorted(keys) == ["p", "q", "s"] and len(set(keys.values())) == 3


def test_migration_turns_stored_ids_into_keys_and_back(db_url):
    engine = make_engine(db_url)
    migrate.upgrade(engine)  # a database at 0006, however the fixture left it
    migrate.downgrade(engine, "0006")
    cols = (
        "source_id, seq, step, ts, duration_s, prefill_tokens, decode_tokens, num_prefill_reqs, "
        "num_decode_reqs, running, waiting, kv_usage, request_ids"
    )
    arr = "ARRAY[{}]::TEXT[]" if engine.dialect.name == "postgresql" else "[{}]::TEXT[]"
    with engine.begin() as conn:
        for seq, (ts, ids) in enumerate([(2.0, ["b", "a"]), (1.0, ["a"]), (3.0, []), (4.0, ["c", "b", "a"])]):
            values = arr.format(", ".join(f"'{i}'" for i in ids))
            row = f"'e', {seq}, {seq}, {ts}, 0.1, 0, 0, 0, 0, 0, 0, 0, {values}"
            conn.exec_driver_sql(f"INSERT INTO steps ({cols}) VALUES ({row})")
    migrate.upgrade(engine)
    with engine.connect() as conn:
        after = conn.exec_driver_sql(f"SELECT seq, {step_request_ids_sql()} FROM steps ORDER BY seq").all()
        keys = dict(conn.exec_driver_sql("SELECT request_id, request_key FROM request_keys").all())
    assert [list(ids) for _, ids in after] == [["b", "a"], ["a"], [], ["c", "b", "a"]]
    assert keys["a"] < keys["b"] < keys["c"]  # numbered by first appearance (step time)
    store = open_store(db_url)  # the writer goes on from the migrated keys
    (res,) = store.write([batch(ENGINE, numbered([_step(9, ["a", "d"], ts=9.0)]))])
    assert (res.accepted, _stored(store)[-1][2]) == (1, ["a", "d"])
    assert len(set(_key_table(store).values())) == 4
    store.close()
    migrate.downgrade(engine, "0006")
    with engine.connect() as conn:
        back = conn.exec_driver_sql(
            "SELECT seq, request_ids FROM steps WHERE source_id = 'e' ORDER BY seq"
        ).all()
        assert conn.execute(sa.text("SELECT count(*) FROM steps")).scalar_one() == 5
    migrate.upgrade(engine)
    engine.dispose()
    assert [list(ids) for _, ids in back] == [["b", "a"], ["a"], [], ["c", "b", "a"]]


def test_replicas_drawing_keys_for_the_same_new_ids_at_once_do_not_deadlock(db_url):
    """Replica A holds a new id "x" in its open transaction; replica B draws keys for "y" and "x" (named
    in that order) and waits on A's "x"; A then draws a key for "y". Taken in the order named, B would
    hold "y" while waiting for "x", and A would wait on B: a deadlock. In one order for everyone, B
    holds nothing while it waits."""
    if not db_url.startswith("postgresql"):
        pytest.skip("replicas write to PostgreSQL; a DuckDB file has one writer")
    one, two = open_store(db_url), open_store(db_url)
    tx_one, tx_two = one._connect(), two._connect()
    got: dict[str, object] = {}

    def draw(store, tx, names, into):
        try:
            got[into] = keys_for(KeyCache(), tx, names, store._insert_keys, store._lookup_keys)[0]
            tx.commit()
        except BaseException as exc:
            got[into] = exc
            tx.rollback()

    try:
        keys_for(KeyCache(), tx_one, [["x"]], one._insert_keys, one._lookup_keys)
        other = threading.Thread(target=draw, args=(two, tx_two, [["y", "x"]], "two"))
        other.start()
        time.sleep(0.5)  # B is waiting on "x" now
        draw(one, tx_one, [["y"]], "one")
        other.join(10)
    finally:
        tx_one.close()
        tx_two.close()
    keys = _key_table(one)
    one.close()
    two.close()
    assert not isinstance(got["one"], BaseException), got["one"]
    assert not isinstance(got["two"], BaseException), got["two"]
    assert got["two"] == [[keys["y"], keys["x"]]] and got["one"] == [[keys["y"]]]


def test_new_ids_are_drawn_in_one_order_whatever_the_order_named():
    seen: list[list[str]] = []

    def insert(conn, ids):
        seen.append(list(ids))
        return {rid: 100 + i for i, rid in enumerate(ids)}

    names = [f"id-{i:02d}" for i in range(20)]
    cache = KeyCache()
    cache.learn({"id-07": 7})
    keys, new, _ = keys_for(cache, None, [names[::-1], names[5:12]], insert, lambda conn, ids: {})
    assert seen == [sorted(set(names) - {"id-07"})]
    assert keys[0][::-1][7] == 7 and len(new) == 19
    assert keys[1] == [new.get(r, 7) for r in names[5:12]]
