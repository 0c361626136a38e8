"""``engine_load``: a fleet by model, the engines worst right now on their own and the rest of each model
as one series, on both backends, over a hand-built fleet with known answers."""

from __future__ import annotations

import pytest

from engine_hooks import events as ev
from ledger.analytics import queries as q
from ledger.analytics.window import Window

T0 = 1_700_000_040.0  # a whole minute: the buckets start at T0 and T0 + 60
# engine -> (model, KV in use in the first minute, in the second, waiting in the second)
FLEET = {
    "a-0": ("a", 0.10, 0.95, 0),
    "a-1": ("a", 0.90, 0.20, 7),
    "a-2": ("a", 0.30, 0.30, 1),
    "b-0": ("b", 0.50, 0.60, 30),
    "b-1": ("b", 0.40, 0.40, 2),
}


def _steps(sid: str) -> ev.Batch:
    model, kv_first, kv_second, waiting = FLEET[sid]
    events = [
        ev.Step(
            seq=k + 1,
            ts=T0 + 15 * k,
            step=k,
            duration_s=0.01 * (1 + k % 2),
            running=4,
            waiting=waiting if k >= 4 else 0,
            kv_usage=kv_second if k >= 4 else kv_first,
        )
        for k in range(8)  # 15 s apart: steps 0..3 in the first minute, 4..7 in the second
    ]
    return ev.Batch(source=ev.Source(id=sid, kind="engine", model=model), events=events)


@pytest.fixture
def fleet(store):
    store.write([_steps(sid) for sid in FLEET])
    return store


def _load(store, **kw):
    with store.engine.connect() as conn:
        return q.engine_load(conn, Window(T0, T0 + 120), bucket_s=60.0, **kw)


def test_engines_rank_worst_first_by_their_newest_bucket(fleet):
    by_kv = _load(fleet, top=2)
    assert [e.source_id for e in by_kv.engines] == ["a-0", "b-0", "b-1", "a-2", "a-1"]
    assert [e.shown for e in by_kv.engines] == [True, True, False, False, False]
    assert by_kv.engines[0].kv_usage == pytest.approx(0.95) and by_kv.engines[0].bucket_ts == T0 + 60
    by_waiting = _load(fleet, top=1, rank_by="waiting")
    assert [e.source_id for e in by_waiting.engines][:2] == ["b-0", "a-1"]
    assert by_waiting.engines[0].step_s == pytest.approx(0.015)


def test_the_worst_engines_are_series_of_their_own_and_the_rest_one_per_model(fleet):
    load = _load(fleet, top=1, source_ids=["b-1"])
    last = {(p.kind, p.series): p for p in load.points if p.bucket_ts == T0 + 60}
    assert set(last) == {
        ("model", "a"),
        ("model", "b"),
        ("engine", "a-0"),
        ("engine", "b-1"),
        ("rest", "a"),
        ("rest", "b"),
    }
    assert last["model", "a"].engines == 3 and last["model", "a"].kv_usage_max == pytest.approx(0.95)
    assert last["model", "a"].kv_usage_mean == pytest.approx((0.95 + 0.20 + 0.30) / 3)
    assert last["rest", "a"].engines == 2 and last["rest", "a"].kv_usage_max == pytest.approx(0.30)
    assert last["rest", "b"].engines == 1 and last["rest", "b"].waiting_max == 30
    assert last["model", "b"].waiting_mean == pytest.approx(16.0)
    assert last["engine", "b-1"].steps == 4 and last["engine", "b-1"].model == "b"
    first = [p for p in load.points if p.bucket_ts == T0]
    assert {p.series for p in first if p.kind == "engine"} == {"a-0", "b-1"}  # the same lines throughout


def test_engine_load_refuses_what_it_cannot_answer(fleet):
    with fleet.engine.connect() as conn:
        with pytest.raises(q.QueryError, match="bucket_s"):
            q.engine_load(conn, Window(T0, T0 + 120), bucket_s=0.001, max_buckets=100)
        with pytest.raises(q.QueryError, match="rank_by"):
            q.engine_load(conn, Window(), rank_by="hot")
        with pytest.raises(q.QueryError, match="top"):
            q.engine_load(conn, Window(), top=q.TOP_MAX + 1)
        assert not q.engine_load(conn, Window(T0 + 3600)).points
