"""Named analytics queries on both backends, over small hand-built engine scenes with known answers."""

from __future__ import annotations

import time

import msgspec
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from engine_hooks import events as ev
from ledger.analytics import queries as q
from ledger.analytics.window import BadTime, Window, parse_time
from ledger.app import create_app
from ledger.config import Settings
from ledger.records import as_json
from tests.support.factories import ENGINE, GATEWAY, batch

T0 = 1_700_000_000.0
STEP_S = [0.010, 0.120, 0.130, 0.110, 0.010, 0.010, 0.010]  # steps 1..3 carry a long prefill


def _seq(events: list) -> list:
    return [msgspec.structs.replace(e, seq=i + 1) for i, e in enumerate(events)]


def scene() -> list:
    """One engine, seven steps back to back from T0.

    * ``dec``   decodes in every step except 2 and 3, which it sits out holding 10 blocks;
    * ``long``  a 1536-token prompt, prefilled 512 per step in steps 1..3, first token at step 3's end;
    * ``short`` queued at step 1's start, scheduled only at step 4 (behind ``long``), one token, done.
    """
    ends, t = [], T0
    for d in STEP_S:
        t += d
        ends.append(t)
    start = [e - d for e, d in zip(ends, STEP_S, strict=True)]
    out: list = [
        ev.Queued(ts=T0 - 1, seq=0, request_id="dec", prompt_tokens=8),
        ev.Chunk(ts=T0 - 1, seq=0, request_id="dec", step=0, tokens=8, computed_before=0, wait_s=0.0),
        ev.Tokens(ts=ends[0], seq=0, request_id="dec", count=1, total=1, kv_blocks=10),
        ev.Queued(ts=start[1], seq=0, request_id="long", prompt_tokens=1536),
        ev.Queued(ts=start[1], seq=0, request_id="short", prompt_tokens=16),
    ]
    for i, s in enumerate((1, 2, 3)):
        out.append(
            ev.Chunk(
                ts=start[s],
                seq=0,
                request_id="long",
                step=s,
                tokens=512,
                computed_before=512 * i,
                kv_blocks=32 * (i + 1),
                wait_s=0.0 if i == 0 else None,
            )
        )
    out.append(ev.Tokens(ts=ends[3], seq=0, request_id="long", count=1, total=1))
    out.append(ev.Finished(ts=ends[3], seq=0, request_id="long", reason="length", output_tokens=1))
    out.append(
        ev.Chunk(
            ts=start[4],
            seq=0,
            request_id="short",
            step=4,
            tokens=16,
            computed_before=0,
            wait_s=start[4] - start[1],
        )
    )
    out.append(ev.Tokens(ts=ends[4], seq=0, request_id="short", count=1, total=1))
    out.append(ev.Finished(ts=ends[4], seq=0, request_id="short", reason="stop", output_tokens=1))
    for s, d in enumerate(STEP_S):
        ran = ["dec"] if s not in (2, 3) else []
        if s in (1, 2, 3):
            ran.append("long")
        if s == 4:
            ran.append("short")
        stalled = ["dec"] if s in (2, 3) else []
        out.append(
            ev.Step(
                ts=start[s],
                seq=0,
                step=s,
                duration_s=d,
                prefill_tokens=512 if s in (1, 2, 3) else (16 if s == 4 else 0),
                decode_tokens=1 if s not in (2, 3) else 0,
                num_decode_reqs=1 if s not in (2, 3) else 0,
                num_prefill_reqs=1 if s in (1, 2, 3, 4) else 0,
                request_ids=ran,
                stalled_request_ids=stalled,
                stalled_kv_blocks=[10] if stalled else [],
            )
        )
    out.append(ev.Tokens(ts=ends[6], seq=0, request_id="dec", count=5, total=6, kv_blocks=10))
    return _seq(out)


@pytest.fixture
def loaded(store):
    store.write([batch(ENGINE, scene())])
    return store


def _conn(store):
    return store.engine.connect()


def _as_json(fn):
    """``fn`` with its record(s) as the API sends them."""
    return lambda *args, **kw: as_json(fn(*args, **kw))


_attribution, _list_requests, _kv_stalls, _request_itl, _decode_itl = (
    _as_json(fn) for fn in (q.attribution, q.list_requests, q.kv_stalls, q.request_itl, q.decode_itl)
)


def _why(conn, request_id: str):
    """``why``'s record as the API sends it."""
    return as_json(q.why(conn, q.WhyQuery(request_id=request_id)))


def test_kv_idle_is_the_time_of_the_steps_a_request_sat_out(loaded):
    row = loaded.get_request("dec")
    assert row["stalled_steps"] == 2
    assert row["kv_idle_s"] == pytest.approx(0.24)
    assert row["kv_idle_block_s"] == pytest.approx(2.4)
    assert row["step_count"] == 5


def test_request_itl_counts_the_gap_across_the_steps_it_sat_out(loaded):
    with _conn(loaded) as conn:
        itl = _request_itl(conn, "dec")
    # first token at step 0's end; tokens at the ends of steps 1, 4, 5, 6 (2 and 3 sat out)
    assert itl["gaps"] == pytest.approx([0.120, 0.130 + 0.110 + 0.010, 0.010, 0.010])
    assert itl["max"] == pytest.approx(0.25)
    assert itl["n"] == 4


def test_request_itl_skips_prefill_steps_and_is_empty_with_one_token(loaded):
    with _conn(loaded) as conn:
        assert _request_itl(conn, "short")["n"] == 0
        assert _request_itl(conn, "nope") is None


def test_decode_itl_weights_step_gaps_by_decoding_requests(loaded):
    with _conn(loaded) as conn:
        (itl,) = _decode_itl(conn)
    # decode steps 1, 4, 5, 6 each follow their predecessor: gaps 0.12, 0.01, 0.01, 0.01 (weight 1 each)
    assert itl["n"] == 4
    assert itl["max"] == pytest.approx(0.12)
    assert itl["p50"] == pytest.approx(0.01)
    assert itl["p99"] == pytest.approx(0.12)


def test_why_names_the_long_prefill_behind_a_short_requests_wait(loaded):
    with _conn(loaded) as conn:
        out = _why(conn, "short")
    first = out["items"][0]
    assert first["kind"] == "engine_queue"
    assert first["seconds"] == pytest.approx(sum(STEP_S[1:4]))
    assert first["culprits"][0]["request_id"] == "long"
    assert first["culprits"][0]["prefill_tokens"] == 1536


def test_why_lists_the_steps_a_decode_sat_out_and_who_filled_them(loaded):
    with _conn(loaded) as conn:
        out = _why(conn, "dec")
    sat = next(i for i in out["items"] if i["kind"] == "sat_out")
    assert sat["steps"] == [2, 3]
    assert sat["seconds"] == pytest.approx(0.24)
    assert sat["culprits"][0]["request_id"] == "long"
    kinds = [i["kind"] for i in out["items"]]
    assert kinds.index("sat_out") < kinds.index("shared_prefill_steps")  # biggest first


def test_why_names_a_culprit_by_its_whole_prompt_not_only_the_chunk_that_shared_the_step(loaded):
    with _conn(loaded) as conn:
        out = _why(conn, "dec")
    shared = next(i for i in out["items"] if i["kind"] == "shared_prefill_steps")
    assert shared["steps"] == [1]
    (culprit,) = shared["culprits"]
    # one 512-token chunk of the long prompt shared the step; the prompt is 1536 tokens in 3 chunks
    assert (culprit["prefill_tokens"], culprit["chunks"]) == (512, 1)
    assert (culprit["prompt_tokens"], culprit["request_chunks"]) == (1536, 3)


def test_why_reports_preemptions_with_their_wait(store):
    evs = _seq(
        [
            ev.Queued(ts=T0, seq=0, request_id="p", prompt_tokens=10),
            ev.Chunk(ts=T0, seq=0, request_id="p", step=0, tokens=10, computed_before=0, wait_s=0.0),
            ev.Preempted(ts=T0 + 1, seq=0, request_id="p", kv_blocks_freed=7, computed_tokens=10),
            ev.Resumed(ts=T0 + 3, seq=0, request_id="p", wait_s=2.0),
        ]
    )
    store.write([batch(ENGINE, evs)])
    with _conn(store) as conn:
        out = _why(conn, "p")
    assert out["items"][0]["kind"] == "preempted" and out["items"][0]["seconds"] == pytest.approx(2.0)
    assert "7 KV blocks freed" in out["items"][0]["detail"]


def test_kv_stalls_rank_live_requests_by_time_without_progress(loaded):
    now = T0 + 10
    with _conn(loaded) as conn:
        rows = _kv_stalls(conn, now)
    assert [r["request_id"] for r in rows] == ["dec"]  # long and short finished
    assert rows[0]["state"] == "running"
    assert rows[0]["stall_s"] == pytest.approx(now - (T0 + sum(STEP_S)))
    with _conn(loaded) as conn:
        assert _kv_stalls(conn, now + 7200, horizon_s=3600) == []  # its engine went quiet


def test_kv_stalls_are_never_negative_when_a_sources_clock_runs_ahead(loaded):
    now = T0 + sum(STEP_S) - 5  # the ledger's clock 5 s behind the engine's last stamp
    with _conn(loaded) as conn:
        rows = _kv_stalls(conn, now)
    assert [r["request_id"] for r in rows] == ["dec"] and rows[0]["stall_s"] == 0


def _finished(rid: str, e2e: float, model_source: ev.Source = ENGINE) -> list:
    return [
        ev.Queued(ts=T0, seq=0, request_id=rid, prompt_tokens=10),
        ev.Chunk(ts=T0, seq=0, request_id=rid, step=0, tokens=10, computed_before=0, wait_s=0.0),
        ev.Tokens(ts=T0 + e2e / 2, seq=0, request_id=rid, count=1, total=1),
        ev.Finished(ts=T0 + e2e, seq=0, request_id=rid, reason="stop", output_tokens=1),
    ]


def test_attribution_gives_tails_per_layer_and_group(store):
    e2es = [0.1 * (i + 1) for i in range(10)]
    evs = [e for i, x in enumerate(e2es) for e in _finished(f"a{i}", x)]
    other = ev.Source(id="engine-1", kind="engine", model="other")
    store.write([batch(ENGINE, _seq(evs)), batch(other, _seq(_finished("b0", 5.0)))])
    with _conn(store) as conn:
        groups = _attribution(conn, group_by=["model"])
    by = {g["model"]: g for g in groups}
    tiny = by["tiny-llama"]["layers"]["e2e_s"]
    assert by["tiny-llama"]["requests"] == 10
    assert tiny["p50"] == pytest.approx(0.55)
    assert tiny["p99"] == pytest.approx(0.991)
    assert tiny["max"] == pytest.approx(1.0)
    assert by["tiny-llama"]["layers"]["ttft_s"]["p50"] == pytest.approx(0.275)
    assert by["other"]["layers"]["e2e_s"]["max"] == pytest.approx(5.0)


def test_attribution_window_is_on_end_time_and_buckets_by_it(store):
    store.write([batch(ENGINE, _seq(_finished("x", 1.0) + _finished("y", 3.0)))])
    with _conn(store) as conn:
        assert _attribution(conn, Window(since=T0 + 2))[0]["requests"] == 1
        buckets = _attribution(conn, bucket_s=2.0)
    assert [(b["bucket_ts"], b["requests"]) for b in buckets] == [(T0, 1), (T0 + 2, 1)]


def test_list_requests_sorts_by_any_column_and_pages(store):
    evs = [e for i, x in enumerate([0.3, 0.1, 0.2]) for e in _finished(f"r{i}", x)]
    evs.append(ev.Queued(ts=T0, seq=0, request_id="live", prompt_tokens=3))
    store.write([batch(ENGINE, _seq(evs))])
    with _conn(store) as conn:
        page = _list_requests(conn, sort="e2e_s", limit=2)
        assert page["total"] == 4
        assert [r["request_id"] for r in page["rows"]] == ["r0", "r2"]
        page2 = _list_requests(conn, sort="e2e_s", limit=2, offset=2)
        assert [r["request_id"] for r in page2["rows"]] == ["r1", "live"]  # NULLs last
        assert [r["request_id"] for r in _list_requests(conn, live=True)["rows"]] == ["live"]
        with pytest.raises(q.QueryError) as exc:
            _list_requests(conn, sort="drop table")
    assert exc.value.field == "sort"


def test_gateway_and_engine_rows_join_in_the_list(store):
    store.write(
        [
            batch(GATEWAY, _seq([ev.Arrived(ts=T0 - 0.5, seq=0, request_id="r0")])),
            batch(ENGINE, _seq(_finished("r0", 1.0))),
        ]
    )
    with _conn(store) as conn:
        (row,) = _list_requests(conn)["rows"]
    assert row["start_ts"] == pytest.approx(T0 - 0.5) and row["e2e_s"] == pytest.approx(1.5)


def test_times_parse_from_unix_iso_and_ages():
    assert parse_time("1700000000") == 1_700_000_000.0
    assert parse_time("2023-11-14T22:13:20Z") == 1_700_000_000.0
    assert parse_time("15m", now=1000.0) == 100.0
    assert parse_time(None) is None
    with pytest.raises(BadTime, match="not a time"):
        parse_time("yesterday")
    with pytest.raises(BadTime, match="after since"):
        Window.parse("10", "5")


RD = {"Authorization": "Bearer r"}


@pytest.fixture
def client(loaded):
    app = create_app(Settings(db_url="duckdb:///:memory:", read_token="r", ingest_token="i"), store=loaded)
    with TestClient(app) as c:
        yield c


def test_analytics_endpoints_answer_with_the_read_token(client):
    assert client.get("/v1/attribution").status_code == 401
    att = client.get("/v1/attribution?group_by=model,finish_reason", headers=RD).json()
    assert {g["finish_reason"] for g in att["groups"]} == {"length", "stop"}
    assert att["itl"][0]["model"] == "tiny-llama"
    listed = client.get("/v1/requests?sort=prompt_tokens&order=asc", headers=RD).json()
    assert [r["request_id"] for r in listed["rows"]] == ["dec", "short", "long"]
    assert client.get("/v1/requests/short/why", headers=RD).json()["items"][0]["kind"] == "engine_queue"
    assert client.get("/v1/requests/dec/itl", headers=RD).json()["n"] == 4
    assert client.get("/v1/itl", headers=RD).json()["itl"][0]["n"] == 4
    stalls = client.get("/v1/kv/stalls?horizon_s=1e10", headers=RD).json()
    assert [r["request_id"] for r in stalls["requests"]] == ["dec"]
    assert stalls["now"] == pytest.approx(time.time(), abs=60)


def test_analytics_endpoints_name_the_bad_parameter(client):
    r = client.get("/v1/requests?sort=nope", headers=RD)
    assert r.status_code == 422 and r.json()["detail"].startswith("sort:")
    r = client.get("/v1/attribution?group_by=tenant", headers=RD)
    assert r.status_code == 422 and r.json()["detail"].startswith("group_by:")
    r = client.get("/v1/attribution?since=yesterday", headers=RD)
    assert r.status_code == 422 and "since/until" in r.json()["detail"]
    assert client.get("/v1/requests/nope/why", headers=RD).status_code == 404
    assert client.get("/v1/requests?limit=0", headers=RD).status_code == 422


def test_why_blames_the_long_prefill_that_shared_a_short_requests_prefill_step(store):
    evs = _seq(
        [
            ev.Queued(ts=T0, seq=0, request_id="big", prompt_tokens=1000),
            ev.Queued(ts=T0, seq=0, request_id="small", prompt_tokens=10),
            ev.Chunk(ts=T0, seq=0, request_id="big", step=0, tokens=1000, computed_before=0, wait_s=0.0),
            ev.Chunk(ts=T0, seq=0, request_id="small", step=0, tokens=10, computed_before=0, wait_s=0.0),
            ev.Step(
                ts=T0,
                seq=0,
                step=0,
                duration_s=0.101,
                prefill_tokens=1010,
                num_prefill_reqs=2,
                request_ids=["big", "small"],
            ),
            ev.Tokens(ts=T0 + 0.101, seq=0, request_id="small", count=1, total=1),
            ev.Finished(ts=T0 + 0.101, seq=0, request_id="small", reason="stop", output_tokens=1),
        ]
    )
    store.write([batch(ENGINE, evs)])
    with _conn(store) as conn:
        out = _why(conn, "small")
    item = next(i for i in out["items"] if i["kind"] == "shared_prefill")
    assert item["seconds"] == pytest.approx(0.1)
    assert item["steps"] == [0] and item["culprits"][0]["request_id"] == "big"


def test_why_names_the_engine_front_end_apart_from_the_engine_queue(store):
    """No gateway: arrival at vLLM's front end -> its scheduler's queue is the front end (tokenising,
    IPC), not engine queueing; a prefill that ran before the request was queued is nobody to blame."""
    evs = _seq(
        [
            ev.Chunk(ts=T0 + 0.1, seq=0, request_id="big", step=0, tokens=512, computed_before=0, wait_s=0.0),
            ev.Queued(ts=T0 + 0.8, seq=0, request_id="late", prompt_tokens=8, arrival_ts=T0),
            ev.Chunk(ts=T0 + 0.9, seq=0, request_id="late", step=1, tokens=8, computed_before=0, wait_s=0.1),
            ev.Tokens(ts=T0 + 0.95, seq=0, request_id="late", count=1, total=1),
            ev.Finished(ts=T0 + 0.95, seq=0, request_id="late", reason="length", output_tokens=1),
        ]
    )
    store.write([batch(ENGINE, evs)])
    with _conn(store) as conn:
        items = {i["kind"]: i for i in _why(conn, "late")["items"]}
    assert items["frontend"]["seconds"] == pytest.approx(0.8)
    assert "front end" in items["frontend"]["detail"] and items["frontend"]["culprits"] == []
    assert items["engine_queue"]["seconds"] == pytest.approx(0.1)
    assert items["engine_queue"]["culprits"] == []


def test_why_splits_the_backend_wait_at_the_engines_door(store):
    """A request the gateway forwarded while the engine host was busy reaches vLLM's scheduler late: the
    time before its queue is ``frontend`` (as ``frontend_s``), the rest ``engine_queue``."""
    engine = _seq(
        [
            ev.Chunk(ts=T0 + 0.1, seq=0, request_id="big", step=0, tokens=512, computed_before=0, wait_s=0.0),
            ev.Queued(ts=T0 + 0.8, seq=0, request_id="late", prompt_tokens=8, arrival_ts=T0 + 0.7),
            ev.Chunk(ts=T0 + 0.9, seq=0, request_id="late", step=1, tokens=8, computed_before=0, wait_s=0.1),
            ev.Tokens(ts=T0 + 0.95, seq=0, request_id="late", count=1, total=1),
            ev.Finished(ts=T0 + 0.95, seq=0, request_id="late", reason="length", output_tokens=1),
        ]
    )
    gateway = _seq(
        [
            ev.Arrived(ts=T0, seq=0, request_id="late", stream=True),
            ev.Admitted(ts=T0, seq=0, request_id="late"),
            ev.Completed(ts=T0 + 0.96, seq=0, request_id="late"),
        ]
    )
    store.write([batch(ENGINE, engine), batch(GATEWAY, gateway)])
    with _conn(store) as conn:
        items = {i["kind"]: i for i in _why(conn, "late")["items"]}
        row = conn.execute(
            sa.text(
                "SELECT frontend_s, engine_queue_s, backend_wait_ttft_s FROM requests "
                "WHERE request_id = 'late'"
            )
        ).one()
    assert items["frontend"]["seconds"] == pytest.approx(0.8) == pytest.approx(row.frontend_s)
    assert "gateway" in items["frontend"]["detail"]
    assert (
        items["engine_queue"]["seconds"] == pytest.approx(0.1) == pytest.approx(row.engine_queue_s, abs=1e-6)
    )
    assert row.backend_wait_ttft_s == pytest.approx(0.9)


def test_why_blames_only_requests_that_held_the_engine_while_it_waited_and_came_before_it(store):
    """``slow`` reached the engine's front end at T0 but its scheduler only at T0+0.5. While it
    waited (T0+0.5 to T0+0.7): ``early`` decoded and ``rival`` prefilled. ``rival`` reached the engine
    after ``slow`` (T0+0.39), so it was ahead only because of slow's front end: not blamed. ``gone``
    ran only before slow was queued: not blamed either."""

    def step(n: int, ts: float, ids: list[str], prefill: int) -> ev.Step:
        return ev.Step(
            ts=ts, seq=0, step=n, duration_s=0.1, prefill_tokens=prefill, num_prefill_reqs=1, request_ids=ids
        )

    evs = _seq(
        [
            ev.Queued(ts=T0 - 1, seq=0, request_id="early", prompt_tokens=8, arrival_ts=T0 - 1),
            ev.Queued(ts=T0 - 1, seq=0, request_id="gone", prompt_tokens=300, arrival_ts=T0 - 1),
            ev.Chunk(ts=T0 + 0.3, seq=0, request_id="gone", step=0, tokens=300, computed_before=0),
            step(0, T0 + 0.3, ["gone", "early"], 300),
            ev.Queued(ts=T0 + 0.4, seq=0, request_id="rival", prompt_tokens=400, arrival_ts=T0 + 0.39),
            ev.Queued(ts=T0 + 0.5, seq=0, request_id="slow", prompt_tokens=4000, arrival_ts=T0),
            ev.Chunk(ts=T0 + 0.5, seq=0, request_id="rival", step=1, tokens=200, computed_before=0),
            step(1, T0 + 0.5, ["rival", "early"], 200),
            ev.Chunk(ts=T0 + 0.6, seq=0, request_id="rival", step=2, tokens=200, computed_before=200),
            step(2, T0 + 0.6, ["rival", "early"], 200),
            ev.Chunk(
                ts=T0 + 0.7, seq=0, request_id="slow", step=3, tokens=256, computed_before=0, wait_s=0.2
            ),
            step(3, T0 + 0.7, ["slow", "early"], 256),
        ]
    )
    store.write([batch(ENGINE, evs)])
    with _conn(store) as conn:
        items = {i["kind"]: i for i in _why(conn, "slow")["items"]}
    wait = items["engine_queue"]
    assert wait["seconds"] == pytest.approx(0.2)
    (held,) = wait["culprits"]
    assert held["request_id"] == "early"
    assert held["steps"] == 2 and held["decode_steps"] == 2 and held["prefill_tokens"] == 0
    assert held["share_s"] == pytest.approx(2 * 0.1 / 201)  # one token of 201 in each of steps 1 and 2
