"""A request is owned by the first engine and the first gateway that name it (``request_sources``):
whatever the group, the writer's cache, a restart, two PostgreSQL replicas racing, or a database from
before the table existed."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

from engine_hooks import events as ev
from ledger import migrate
from ledger.store import make_engine, open_store
from tests.support.factories import ENGINE, GATEWAY, batch, numbered

OTHER = ev.Source(id="engine-1", kind="engine", model="other-model")


def _queued(rid: str, seq: int = 0) -> ev.Queued:
    return ev.Queued(seq=seq, ts=100.0, request_id=rid, prompt_tokens=5)


def _tokens(rid: str, total: int) -> ev.Tokens:
    return ev.Tokens(seq=0, ts=101.0, request_id=rid, count=total, total=total)


def _row(store, rid: str) -> dict:
    row = store.get_request(rid)
    assert row is not None
    return row


def test_the_first_engine_and_gateway_own_a_request_across_restarts(db_url):
    store = open_store(db_url)
    store.write([batch(ENGINE, numbered([_queued("r"), _tokens("r", 3)]))])
    store.close()
    store = open_store(db_url)  # an empty cache: the owners come from the table
    (res,) = store.write([batch(OTHER, numbered([_tokens("r", 99), _queued("mine")]))])
    assert (res.accepted, res.duplicates, res.foreign) == (1, 0, ["r"])
    arrived = ev.Arrived(seq=1, ts=99.0, request_id="r")
    (res,) = store.write([batch(GATEWAY, [arrived])])  # another kind: the request's gateway
    assert (res.accepted, res.foreign) == (1, [])
    (res,) = store.write([batch(ENGINE, numbered([_tokens("r", 5)], 3))])
    assert (res.accepted, res.foreign) == (1, [])
    row = _row(store, "r")
    assert (row["engine_source_id"], row["gateway_source_id"], row["output_tokens"]) == (
        "engine-0",
        "gw-0",
        5,
    )
    assert row["model"] == ENGINE.model
    store.close()


def test_an_owned_id_the_cache_let_go_of_is_still_refused_to_another_engine(db_url):
    """The DuckDB writer inserts the ids its cache does not know as new; one stored after all fails
    that insert and the group is written again with a lookup: nothing lost, the owner kept."""
    from ledger.store.request_keys import KeyCache

    store = open_store(db_url)
    store._owners = KeyCache(2)  # two ids a generation: "r" is forgotten after the next groups
    store.write([batch(ENGINE, numbered([_queued("r")]))])
    for i in range(3):
        store.write([batch(ENGINE, numbered([_queued(f"n{i}a"), _queued(f"n{i}b")], 10 + 10 * i))])
    assert store._owners.peek("r") is None
    (res,) = store.write([batch(OTHER, numbered([_tokens("r", 99), _queued("mine")]))])
    assert (res.accepted, res.foreign) == (1, ["r"])
    assert _row(store, "mine")["engine_source_id"] == "engine-1"
    assert _row(store, "r")["engine_source_id"] == "engine-0"
    store.close()


def test_two_engines_naming_one_new_request_in_one_group_the_first_owns_it(db_url):
    store = open_store(db_url)
    step = ev.Step(seq=2, ts=100.5, step=0, duration_s=0.01, request_ids=["x"], stalled_request_ids=["r"])
    first, second = store.write(
        [batch(ENGINE, numbered([_queued("r")])), batch(OTHER, numbered([_queued("r"), step]))]
    )
    assert (first.accepted, first.foreign) == (1, [])
    assert (second.accepted, second.duplicates, second.foreign) == (0, 0, ["r"])  # the step named it too
    assert _row(store, "r")["stalled_steps"] == 0
    store.close()


def test_a_database_from_before_owners_keeps_its_requests_owned(db_url):
    engine = make_engine(db_url)
    migrate.upgrade(engine)
    migrate.downgrade(engine, "0008")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO request_rows (request_id, engine_source_id, gateway_source_id) "
            "VALUES ('old', 'engine-0', 'gw-0')"
        )
    migrate.upgrade(engine)
    engine.dispose()
    store = open_store(db_url)
    (res,) = store.write([batch(OTHER, numbered([_tokens("old", 9)]))])
    assert res.foreign == ["old"]
    (res,) = store.write([batch(ENGINE, numbered([_tokens("old", 9)]))])
    assert res.foreign == []
    store.close()


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_two_postgresql_replicas_claiming_the_same_new_requests_agree_on_one_owner(db_url):
    stores = [open_store(db_url), open_store(db_url)]
    sources = [ENGINE, OTHER]
    ids = [f"race-{i}" for i in range(30)]
    results: list[list] = [[], []]
    for rid in ids:
        barrier = threading.Barrier(2)

        def claim(i: int, rid: str = rid, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            results[i].append(stores[i].write([batch(sources[i], [_queued(rid, seq=ids.index(rid) + 1)])])[0])

        threads = [threading.Thread(target=claim, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for n, rid in enumerate(ids):
        won = [not results[i][n].foreign for i in (0, 1)]
        assert won.count(True) == 1, (rid, results[0][n], results[1][n])
        owner = sources[won.index(True)].id
        assert _row(stores[0], rid)["engine_source_id"] == owner
    with stores[0].engine.connect() as conn:
        owned = dict(conn.execute(sa.text("SELECT request_id, engine_source_id FROM request_sources")).all())
    assert {rid: owned[rid] for rid in ids} == {rid: _row(stores[0], rid)["engine_source_id"] for rid in ids}
    for s in stores:
        s.close()
