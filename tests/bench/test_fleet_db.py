"""The fleet database the read benchmark builds with SQL (``bench.fleet_db``) holds what the ledger
stores when the same fleet's events go through the real write path (``Store.write``, compacted): the
same steps (their requests by id), events, request rows, owners and sources, and the same answers from
the analytics the API serves."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa

from bench.fleet_db import Fleet, batches_for, build
from ledger import schema
from ledger.analytics import queries as q
from ledger.analytics.window import Window
from ledger.store import open_store

# Small in every direction but the shape: 3 engines of 3 models, 8 slots, 40 s; requests of 60-200
# steps, so that each slot runs several, some are live at the end and the ramp is part of the hour.
SMALL = Fleet(engines=3, slots=8, seconds=40, min_steps=60, max_steps=200, end_ts=1_800_000_000.0)


@pytest.fixture(scope="module")
def ledgers(tmp_path_factory: pytest.TempPathFactory) -> tuple[sa.Engine, sa.Engine]:
    tmp = tmp_path_factory.mktemp("fleet")
    built = tmp / "built.duckdb"
    build(str(built), SMALL)
    ingested = tmp / "ingested.duckdb"
    store = open_store(f"duckdb:///{ingested}")
    try:
        feeds = [list(batches_for(SMALL, e)) for e in range(SMALL.engines)]
        for group in zip(*feeds, strict=False):  # the engines' batches interleaved, as they arrive
            results = store.write(list(group))
            assert not any(r.conflicts or r.foreign for r in results)
        store.compact(force=True)
    finally:
        store.close()
    return sa.create_engine(f"duckdb:///{built}"), sa.create_engine(f"duckdb:///{ingested}")


def _rows(engine: sa.Engine, sql: str) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.text(sql))]


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
    return bool(a == b)


def _same(built: list[dict[str, Any]], ingested: list[dict[str, Any]], what: str) -> None:
    assert len(built) == len(ingested), what
    for x, y in zip(built, ingested, strict=True):
        diff = {k: (x[k], y[k]) for k in x if not _close(x[k], y[k])}
        assert not diff, f"{what}: {diff}"


def test_the_fleet_has_its_shape(ledgers: tuple[sa.Engine, sa.Engine]) -> None:
    shape = _rows(
        ledgers[0],
        "SELECT (SELECT count(*) FROM steps) AS steps, (SELECT count(DISTINCT source_id) FROM steps) AS "
        "engines, (SELECT count(*) FROM requests WHERE end_ts IS NULL) AS live, (SELECT count(*) FROM "
        "requests WHERE end_ts IS NOT NULL) AS finished, (SELECT count(DISTINCT model) FROM sources) AS "
        "models, (SELECT min(running) FROM steps WHERE step >= 128) AS running",
    )[0]
    assert shape["steps"] == SMALL.engines * SMALL.n_steps and shape["engines"] == SMALL.engines
    assert shape["live"] == SMALL.n_slots  # every slot runs a request when the hour ends
    assert shape["finished"] > 2 * SMALL.n_slots and shape["models"] == 3
    assert shape["running"] == SMALL.slots  # after the ramp, every slot in every step


def test_steps_are_what_the_store_writes(ledgers: tuple[sa.Engine, sa.Engine]) -> None:
    ids = schema.step_request_ids_sql("steps")
    sql = (
        "SELECT source_id, seq, step, ts, duration_s, prefill_tokens, decode_tokens, num_prefill_reqs, "
        "num_decode_reqs, running, waiting, kv_usage, prefill_depth_tokens, max_prefill_depth, "
        f"stalled_request_ids, interval_s, {ids} AS request_ids FROM steps ORDER BY source_id, step"
    )
    _same(*(_rows(e, sql) for e in ledgers), "steps")


def test_events_are_what_the_store_writes(ledgers: tuple[sa.Engine, sa.Engine]) -> None:
    sql = "SELECT source_id, seq, ts, kind, request_id, data FROM events ORDER BY source_id, seq"
    built, ingested = (_rows(e, sql) for e in ledgers)
    for rows in (built, ingested):
        for r in rows:
            r["data"] = msgspec.json.decode(r["data"]) if r["data"] is not None else None
    assert {r["kind"] for r in built} == {"step", "queued", "chunk", "finished"}
    _same(built, ingested, "events")


def test_request_rows_owners_and_sources_are_what_the_store_writes(
    ledgers: tuple[sa.Engine, sa.Engine],
) -> None:
    _same(*(_rows(e, "SELECT * FROM requests ORDER BY request_id") for e in ledgers), "requests")
    _same(*(_rows(e, "SELECT * FROM request_sources ORDER BY request_id") for e in ledgers), "owners")
    sources = (
        "SELECT source_id, kind, model, last_seq, events_total, dropped_total, producer FROM sources "
        "ORDER BY source_id"
    )
    _same(*(_rows(e, sources) for e in ledgers), "sources")
    keys = "SELECT request_id FROM request_keys ORDER BY request_id"
    _same(*(_rows(e, keys) for e in ledgers), "request ids with keys")
    assert not _rows(ledgers[0], "SELECT * FROM request_parts")  # compacted, as after a compaction


def _answers(engine: sa.Engine, rid: str, live: str) -> list[Any]:
    window = Window(SMALL.t0, SMALL.end_ts)
    with engine.connect() as conn:
        return [
            q.attribution(conn, window, group_by=["model"], bucket_s=10.0),
            q.decode_itl(conn, window, group_by_model=True),
            q.list_requests(conn, window, sort="e2e_s", limit=50),
            q.list_requests(conn, window, live=True, model=SMALL.models[1], sort="start_ts"),
            q.kv_stalls(conn, SMALL.end_ts + 1, limit=20),
            q.why(conn, q.WhyQuery(request_id=rid)),
            q.request_itl(conn, rid),
            q.request_itl(conn, live),
        ]


def test_the_analytics_answer_the_same_over_both(ledgers: tuple[sa.Engine, sa.Engine]) -> None:
    pick = "SELECT request_id FROM requests WHERE end_ts IS {} NULL ORDER BY {} LIMIT 1"
    first = _rows(ledgers[0], pick.format("NOT", "e2e_s DESC"))[0]["request_id"]
    live = _rows(ledgers[0], pick.format("", "start_ts"))[0]["request_id"]
    built, ingested = (_answers(e, first, live) for e in ledgers)
    assert built[0] and built[1] and built[2].rows and built[5] is not None and built[6].n > 50
    for a, b in zip(built, ingested, strict=True):
        x, y = msgspec.to_builtins(a), msgspec.to_builtins(b)
        assert _approx(x, y), (x, y)


def _approx(x: Any, y: Any) -> bool:
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_approx(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_approx(a, b) for a, b in zip(x, y, strict=True))
    if isinstance(x, float) and isinstance(y, float):
        return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)
    return bool(x == y)
