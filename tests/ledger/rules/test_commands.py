"""Commands: stored decisions, re-delivered in ingest responses and by long-poll until confirmed.

Every test runs on DuckDB and PostgreSQL (``db_url``), against the app with its real writer thread.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from engine_hooks import events as ev
from ledger.app import create_app
from ledger.config import Settings
from ledger.store import open_store

ENGINE = ev.Source(id="e0", kind="engine", model="m")
GATEWAY = ev.Source(id="g0", kind="gateway")
ING = {"Authorization": "Bearer ing"}
ADM = {"Authorization": "Bearer adm"}
RD = {"Authorization": "Bearer rd"}


def settings(db_url: str, **kw) -> Settings:
    return Settings(db_url=db_url, ingest_token="ing", read_token="rd", admin_token="adm", **kw)


class Src:
    """A source that numbers its events."""

    def __init__(self, client: TestClient, source: ev.Source, seq: int = 1):
        self.c, self.source, self.seq = client, source, seq

    def send(self, *events) -> dict:
        evs = []
        for e in events:
            evs.append(msgspec.structs.replace(e, seq=self.seq))
            self.seq += 1
        r = self.c.post("/v1/events", content=ev.encode_batch(self.source, evs), headers=ING)
        assert r.status_code == 200, r.text
        return r.json()


def looping_tokens(rid: str, n: int = 200, ts: float | None = None) -> list:
    ids = [101, 2023, 318] * n
    t = ts or time.time()
    return [
        ev.Tokens(
            seq=0, ts=t, request_id=rid, count=16, total=(i + 1) * 16, token_ids=ids[i * 16 : (i + 1) * 16]
        )
        for i in range(n // 16)
    ]


def cutoff_rows(db_url: str) -> list[dict]:
    eng = sa.create_engine(db_url)
    try:
        with eng.connect() as conn:
            return [
                dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM cutoffs ORDER BY decided_ts"))
            ]
    finally:
        eng.dispose()


def test_command_is_redelivered_in_every_response_until_cutoff_applied(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        eng = Src(c, ENGINE)
        first = eng.send(
            ev.Queued(seq=0, ts=time.time(), request_id="r1", prompt_tokens=9), *looping_tokens("r1")
        )
        assert [(x["request_id"], x["action"], x["rule"]) for x in first["commands"]] == [
            ("r1", "abort", "loop")
        ]
        cmd = first["commands"][0]
        assert "period 3" in cmd["detail"]
        # unrelated traffic from the same source keeps carrying it, and so does the poll endpoint
        again = eng.send(ev.Queued(seq=0, ts=time.time(), request_id="other", prompt_tokens=3))
        assert again["commands"] == [cmd]
        assert c.get("/v1/commands", params={"source_id": "e0"}, headers=ING).json() == {"commands": [cmd]}
        assert c.get("/v1/commands", params={"source_id": "someone-else"}, headers=ING).json() == {
            "commands": []
        }
        confirm = eng.send(
            ev.CutoffApplied(
                seq=0, ts=time.time(), request_id="r1", command_id=cmd["id"], action="abort", rule="loop"
            ),
            ev.Finished(
                seq=0, ts=time.time(), request_id="r1", reason="cutoff", stop_reason="chunkledger:loop"
            ),
        )
        assert confirm["commands"] == []
        assert eng.send(ev.Queued(seq=0, ts=time.time(), request_id="x", prompt_tokens=3))["commands"] == []
        listed = c.get("/v1/cutoffs", params={"request_id": "r1"}, headers=RD).json()["cutoffs"]
    (row,) = cutoff_rows(db_url)
    assert listed[0]["command_id"] == row["command_id"] == cmd["id"]
    assert row["state"] == "applied" and row["applied_source_id"] == "e0"
    assert row["decided_ts"] <= row["delivered_ts"] <= row["applied_ts"]
    assert row["deliveries"] == 3  # two ingest responses and one poll (the confirming batch gets none)


def test_long_poll_returns_as_soon_as_a_command_is_decided(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        eng = Src(c, ENGINE)
        eng.send(ev.Queued(seq=0, ts=time.time(), request_id="r1", prompt_tokens=9))
        got = {}

        def poll():
            t0 = time.monotonic()
            got["body"] = c.get("/v1/commands", params={"source_id": "e0", "wait_s": 20}, headers=ING).json()
            got["took"] = time.monotonic() - t0

        th = threading.Thread(target=poll)
        th.start()
        time.sleep(0.5)
        eng.send(*looping_tokens("r1"))
        th.join(15)
        assert [x["rule"] for x in got["body"]["commands"]] == ["loop"]
        assert 0.4 < got["took"] < 5
        t0 = time.monotonic()
        empty = c.get("/v1/commands", params={"source_id": "idle", "wait_s": 0.3}, headers=ING)
        assert empty.json() == {"commands": []} and time.monotonic() - t0 >= 0.3


def test_commands_endpoint_checks_token_and_parameters(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        assert c.get("/v1/commands", params={"source_id": "e0"}).status_code == 401
        assert c.get("/v1/commands", params={"source_id": "e0"}, headers=RD).status_code == 403
        bad = c.get("/v1/commands", params={"source_id": "e0", "wait_s": 999}, headers=ING)
        assert bad.status_code == 422 and "wait_s" in bad.text
        assert c.get("/v1/commands", headers=ING).status_code == 422


def test_pending_commands_survive_a_restart_and_a_decision_is_never_made_twice(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        eng = Src(c, ENGINE)
        cmd = eng.send(*looping_tokens("r1"))["commands"][0]
        seq = eng.seq
    with TestClient(create_app(settings(db_url))) as c:
        eng = Src(c, ENGINE, seq)
        # the new process has no live state for r1: more looping tokens make it decide again, but the
        # stored decision wins and the same command keeps going out
        resp = eng.send(*looping_tokens("r1", 400)[12:])
        assert resp["commands"] == [cmd]
    rows = cutoff_rows(db_url)
    assert len(rows) == 1 and rows[0]["state"] == "pending" and rows[0]["deliveries"] == 2


def test_streaming_gateway_gets_the_command_too_and_each_target_confirms(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        gw, eng = Src(c, GATEWAY), Src(c, ENGINE)
        gw.send(ev.Arrived(seq=0, ts=time.time(), request_id="r1", stream=True))
        cmd = eng.send(*looping_tokens("r1"))["commands"][0]
        assert gw.send(ev.FirstByte(seq=0, ts=time.time(), request_id="r1"))["commands"] == [cmd]
        eng.send(
            ev.CutoffApplied(
                seq=0, ts=time.time(), request_id="r1", command_id=cmd["id"], action="abort", rule="loop"
            )
        )
        assert eng.send(ev.Queued(seq=0, ts=time.time(), request_id="z", prompt_tokens=1))["commands"] == []
        assert gw.send(ev.Admitted(seq=0, ts=time.time(), request_id="q"))["commands"] == [
            cmd
        ]  # gateway: not yet
        gw.send(ev.StreamCut(seq=0, ts=time.time(), request_id="r1", rule="loop", command_id=cmd["id"]))
        assert gw.send(ev.Admitted(seq=0, ts=time.time(), request_id="q2"))["commands"] == []
    (row,) = cutoff_rows(db_url)
    assert row["gateway_source_id"] == "g0" and row["gateway_applied_ts"] is not None
    assert row["applied_ts"] is not None and row["state"] == "applied"


def test_a_gateway_whose_events_come_after_the_decision_still_gets_the_command(db_url):
    """The engine's batch reached the ledger first (a gateway flushes on its own timer): the gateway
    becomes a target when its arrival is seen, on its own answer and on a long-poll."""
    with TestClient(create_app(settings(db_url))) as c:
        gw, eng = Src(c, GATEWAY), Src(c, ENGINE)
        cmd = eng.send(*looping_tokens("r1"))["commands"][0]
        assert gw.send(ev.Admitted(seq=0, ts=time.time(), request_id="other"))["commands"] == []
        assert gw.send(ev.Arrived(seq=0, ts=time.time(), request_id="r1", stream=True))["commands"] == [cmd]
        polled = c.get("/v1/commands", params={"source_id": "g0"}, headers=ING).json()["commands"]
        assert polled == [cmd]
        gw.send(ev.StreamCut(seq=0, ts=time.time(), request_id="r1", rule="loop", command_id=cmd["id"]))
        assert gw.send(ev.Admitted(seq=0, ts=time.time(), request_id="q"))["commands"] == []
        assert eng.send(ev.Queued(seq=0, ts=time.time(), request_id="z", prompt_tokens=1))["commands"] == [
            cmd
        ]
    (row,) = cutoff_rows(db_url)
    assert row["gateway_source_id"] == "g0" and row["gateway_applied_ts"] is not None
    assert row["applied_ts"] is None and row["state"] == "pending"  # the engine has not confirmed


def test_a_long_poll_is_woken_when_its_gateway_joins_a_decided_request(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        gw, eng = Src(c, GATEWAY), Src(c, ENGINE)
        cmd = eng.send(*looping_tokens("r1"))["commands"][0]
        answer: dict = {}

        def poll() -> None:
            started = time.monotonic()
            r = c.get("/v1/commands", params={"source_id": "g0", "wait_s": 20}, headers=ING)
            answer.update(r.json(), took=time.monotonic() - started)

        t = threading.Thread(target=poll)
        t.start()
        time.sleep(0.5)
        assert not answer  # nothing for g0 yet: the poll waits
        gw.send(ev.Arrived(seq=0, ts=time.time(), request_id="r1", stream=True))  # the poll answers now
        t.join(10)
        assert answer["commands"] == [cmd] and answer["took"] < 5


def test_a_request_that_ends_on_its_own_makes_its_command_moot(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        eng = Src(c, ENGINE)
        cmd = eng.send(*looping_tokens("r1"))["commands"][0]
        eng.send(ev.Finished(seq=0, ts=time.time(), request_id="r1", reason="length"))
        assert eng.send(ev.Queued(seq=0, ts=time.time(), request_id="z", prompt_tokens=1))["commands"] == []
    (row,) = cutoff_rows(db_url)
    assert row["command_id"] == cmd["id"] and row["state"] == "moot" and row["applied_ts"] is None


def test_unconfirmed_commands_expire_after_the_ttl(db_url):
    app = create_app(settings(db_url))
    with TestClient(app) as c:
        c.put("/v1/policy", json={"commands": {"ttl_s": 30}}, headers=ADM).raise_for_status()
        eng = Src(c, ENGINE)
        eng.send(*looping_tokens("r1"))
        app.state.runaway.tick(time.time() + 31)
        assert eng.send(ev.Queued(seq=0, ts=time.time(), request_id="z", prompt_tokens=1))["commands"] == []
    assert cutoff_rows(db_url)[0]["state"] == "expired"


def test_policy_api_versions_validates_and_takes_effect(db_url, tmp_path):
    pol = tmp_path / "policy.toml"
    pol.write_text("[rules]\nmax_output_tokens = 5000\n")
    with TestClient(create_app(settings(db_url, policy_file=str(pol)))) as c:
        assert c.get("/v1/policy").status_code == 401
        assert c.get("/v1/policy", headers=RD).status_code == 403
        cur = c.get("/v1/policy", headers=ADM).json()
        assert cur["origin"] == "file" and cur["policy"]["rules"]["max_output_tokens"] == 5000
        bad = c.put("/v1/policy", json={"rules": {"max_output_tokens": -1}}, headers=ADM)
        assert bad.status_code == 422 and "rules.max_output_tokens" in bad.json()["detail"]
        assert c.put("/v1/policy", content=b"{", headers=ADM).status_code == 422
        deep = c.put("/v1/policy", content=b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}", headers=ADM)
        assert deep.status_code == 422 and "nested deeper" in deep.json()["detail"]
        new = c.put("/v1/policy", json={"rules": {"max_output_tokens": 20}}, headers=ADM).json()
        assert new["version"] == cur["version"] + 1 and new["origin"] == "api"
        resp = Src(c, ENGINE).send(ev.Tokens(seq=0, ts=time.time(), request_id="r", count=32, total=32))
        assert [x["rule"] for x in resp["commands"]] == ["token_cap"]
    # a restart keeps the API's version: the unchanged file does not override it
    with TestClient(create_app(settings(db_url, policy_file=str(pol)))) as c:
        assert c.get("/v1/policy", headers=ADM).json()["policy"]["rules"]["max_output_tokens"] == 20


@pytest.mark.parametrize("kind", ["bad toml", "bad field"])
def test_a_bad_policy_file_stops_the_service_naming_the_field(tmp_path, kind):
    pol = tmp_path / "policy.toml"
    pol.write_text("rules = [" if kind == "bad toml" else "[rules]\nstall_timeout_s = -5\n")
    from ledger.rules.policy import PolicyError

    app = create_app(settings(f"duckdb:///{tmp_path}/x.duckdb", policy_file=str(pol)))
    with (
        pytest.raises(PolicyError, match="stall_timeout_s" if kind == "bad field" else "not valid toml"),
        TestClient(app),
    ):
        pass


def test_a_response_carries_at_most_256_commands_oldest_first():
    from ledger.rules.commands import MAX_PER_RESPONSE, CommandBook
    from ledger.rules.engine import Decision

    book = CommandBook(None)
    decisions = [Decision(f"r{i}", "token_cap", "abort", "d", "m", "e0", None, float(i)) for i in range(300)]
    assert len(book.record(decisions)) == 300
    first = book.for_source("e0")
    assert len(first) == MAX_PER_RESPONSE == 256 and first[0].request_id == "r0"
    book.mark_delivered("e0", first, "ingest")
    for c in first:
        book.confirm("e0", c.id, 0.0)
    assert [c.request_id for c in book.for_source("e0")] == [f"r{i}" for i in range(256, 300)]


def test_many_decisions_in_one_batch_are_stored_and_delivered_together(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        c.put("/v1/policy", json={"rules": {"max_output_tokens": 10}}, headers=ADM).raise_for_status()
        eng = Src(c, ENGINE)
        t = time.time()
        got = eng.send(*[ev.Tokens(seq=0, ts=t, request_id=f"r{i}", count=16, total=16) for i in range(5)])
        assert sorted(x["request_id"] for x in got["commands"]) == [f"r{i}" for i in range(5)]
        again = eng.send(ev.Queued(seq=0, ts=t, request_id="z", prompt_tokens=1))
        assert [x["id"] for x in again["commands"]] == [x["id"] for x in got["commands"]]
        for x in got["commands"][:2]:
            eng.send(
                ev.CutoffApplied(
                    seq=0,
                    ts=t,
                    request_id=x["request_id"],
                    command_id=x["id"],
                    action="abort",
                    rule="token_cap",
                )
            )
    rows = {r["request_id"]: r for r in cutoff_rows(db_url)}
    assert len(rows) == 5 and all(r["delivered_ts"] is not None for r in rows.values())
    applied = {x["request_id"] for x in got["commands"][:2]}
    for rid, r in rows.items():
        assert r["state"] == ("applied" if rid in applied else "pending"), r
        # 2 ingest responses, plus one more for each response before that command's confirming batch
        assert r["deliveries"] >= 2


def test_a_cutoff_is_decided_and_polled_while_the_store_is_still_committing(db_url):
    """The rule engine sees a batch on arrival: a stalled database commit does not delay the cutoff."""
    store = open_store(db_url)
    stall = threading.Event()
    real_write = store.write

    def slow_write(batches, *rest):
        if stall.is_set():
            time.sleep(3.0)
        return real_write(batches, *rest)

    store.write = slow_write  # type: ignore[method-assign]
    try:
        with TestClient(create_app(settings(db_url), store=store)) as c:
            eng = Src(c, ENGINE)
            eng.send(ev.Queued(seq=0, ts=time.time(), request_id="r1", prompt_tokens=9))
            stall.set()
            posted = {}

            def post():
                posted["answer"] = eng.send(*looping_tokens("r1"))
                posted["at"] = time.monotonic()

            t0 = time.monotonic()
            th = threading.Thread(target=post)
            th.start()
            polled = c.get("/v1/commands", params={"source_id": "e0", "wait_s": 10}, headers=ING).json()
            polled_at = time.monotonic()
            th.join(15)
            assert [x["rule"] for x in polled["commands"]] == ["loop"]
            assert polled_at - t0 < 2.0 < posted["at"] - t0  # decided long before the commit returned
            assert posted["answer"]["commands"] == polled["commands"]  # and it rides on that answer too
    finally:
        store.close()


def test_the_rules_go_on_with_other_batches_while_a_decision_waits_to_be_stored(db_url):
    """Storing a cutoff waits on a database commit (behind the ingest writer's, on DuckDB). The intake
    must not: another source's batch is observed and answered meanwhile; the batch that made the
    decision is answered once it is stored, with the command on it."""
    with TestClient(create_app(settings(db_url))) as c:
        book = c.app.state.runaway.book
        real_record = book.record
        release = threading.Event()

        def slow_record(decisions):
            release.wait(10)
            return real_record(decisions)

        book.record = slow_record
        eng, other = Src(c, ENGINE), Src(c, ev.Source(id="e1", kind="engine", model="m"))
        eng.send(ev.Queued(seq=0, ts=time.time(), request_id="r1", prompt_tokens=9))
        posted = {}

        def post():
            posted["answer"] = eng.send(*looping_tokens("r1"))

        th = threading.Thread(target=post)
        th.start()
        time.sleep(0.5)  # the loop is decided; storing it waits
        t0 = time.monotonic()
        other.send(ev.Queued(seq=0, ts=time.time(), request_id="r2", prompt_tokens=9))
        took = time.monotonic() - t0
        waiting = th.is_alive()
        release.set()
        th.join(15)
    assert took < 2.0 and waiting  # answered while the decision's batch still waited
    assert [x["rule"] for x in posted["answer"]["commands"]] == ["loop"]


def test_a_finished_request_whose_command_turns_moot_does_not_hold_up_other_batches(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        book = c.app.state.runaway.book
        eng, other = Src(c, ENGINE), Src(c, ev.Source(id="e1", kind="engine", model="m"))
        eng.send(ev.Queued(seq=0, ts=time.time(), request_id="r1", prompt_tokens=9))
        assert [x["rule"] for x in eng.send(*looping_tokens("r1"))["commands"]] == ["loop"]
        real_done = book.request_done
        release = threading.Event()

        def slow_done(request_id, source_id):
            release.wait(10)
            return real_done(request_id, source_id)

        book.request_done = slow_done
        posted = {}
        finished = ev.Finished(seq=0, ts=time.time(), request_id="r1", reason="stop", output_tokens=200)
        th = threading.Thread(target=lambda: posted.update(answer=eng.send(finished)))
        th.start()
        time.sleep(0.5)  # r1's end is observed; marking its command moot waits
        t0 = time.monotonic()
        other.send(ev.Queued(seq=0, ts=time.time(), request_id="r2", prompt_tokens=9))
        took = time.monotonic() - t0
        release.set()
        th.join(15)
        time.sleep(0.2)
        rows = {r["request_id"]: r["state"] for r in cutoff_rows(db_url)}
    assert took < 2.0
    assert "answer" in posted and rows == {"r1": "moot"}


def test_an_older_batch_replayed_after_newer_ones_is_still_seen_by_the_rules(db_url):
    with TestClient(create_app(settings(db_url))) as c:
        eng = Src(c, ENGINE, seq=100)
        eng.send(ev.Queued(seq=0, ts=time.time(), request_id="other", prompt_tokens=3))
        replay = Src(c, ENGINE, seq=1)  # e.g. a spooled batch delivered after the source came back
        answer = replay.send(*looping_tokens("r2"))
        assert [(x["request_id"], x["rule"]) for x in answer["commands"]] == [("r2", "loop")]
        again = Src(c, ENGINE, seq=1).send(*looping_tokens("r2"))  # a plain retry: no new decision
        assert again["duplicates"] == len(looping_tokens("r2"))
    assert len(cutoff_rows(db_url)) == 1


def test_a_decision_recorded_just_after_its_gateway_joined_targets_that_gateway():
    """The ticker decided (a timeout) before the gateway's arrival was observed, and records it just
    after: the joined gateway is a target all the same, until the request is done."""
    from ledger.rules.commands import CommandBook
    from ledger.rules.engine import Decision

    book = CommandBook(None)
    book.add_gateway("r1", "g0")  # nothing pending yet
    (_, p), (_, q) = book.record(
        [
            Decision("r1", "wall_clock_timeout", "abort", "d", "m", "e0", None, 1.0),
            Decision("r2", "wall_clock_timeout", "abort", "d", "m", "e0", None, 1.0),
        ]
    )
    assert p.targets == {"e0": "engine", "g0": "gateway"} and q.targets == {"e0": "engine"}
    assert [c.request_id for c in book.for_source("g0")] == ["r1"]
    book.request_done("r1", "g0")
    assert book.for_source("g0") == []
    ((_, later),) = book.record([Decision("r1", "stall_timeout", "abort", "d", "m", "e0", None, 2.0)])
    assert later.targets == {"e0": "engine"}  # the gateway finished it: no stream left to cut


def test_policy_api_overrides_are_typed_partial_settings(db_url, tmp_path):
    """An unknown override field is a 422 naming it (nothing stored); an accepted override is answered
    as set (only its fields), matches the schema the document publishes, and a restart on the unchanged
    file keeps its version."""
    import jsonschema

    pol = tmp_path / "policy.toml"
    pol.write_text('[models."m".rules]\nstall_timeout_s = 0\nloop = { min_repeats = 3 }\n')
    with TestClient(create_app(settings(db_url, policy_file=str(pol)))) as c:
        cur = c.get("/v1/policy", headers=ADM).json()
        assert cur["policy"]["models"] == {
            "m": {"rules": {"stall_timeout_s": None, "loop": {"min_repeats": 3}}, "slo": {}}
        }
        for override, field in [
            ({"rules": {"max_output_tokenz": 5}}, "models.m: max_output_tokenz"),
            ({"slo": {"itl_p99": 0.1}}, "models.m: itl_p99"),
        ]:
            bad = c.put("/v1/policy", json={"models": {"m": override}}, headers=ADM)
            assert bad.status_code == 422 and field in bad.json()["detail"], bad.text
        assert c.get("/v1/policy", headers=ADM).json()["version"] == cur["version"]
        doc = c.get("/openapi.json").json()
        partial = doc["components"]["schemas"]["PartialRuleSettings"]
        assert {"max_output_tokens", "stall_timeout_s", "loop", "near_loop"} <= set(partial["properties"])
        answer = doc["paths"]["/v1/policy"]["put"]["responses"]["200"]["content"]["application/json"]
        validator = jsonschema.Draft202012Validator({**answer["schema"], "components": doc["components"]})
        models = {"m": {"rules": {"max_output_tokens": 9}, "slo": {"ttft_p99_s": 0.5}}, "n": {}}
        new = c.put("/v1/policy", json={"models": models}, headers=ADM).json()
        assert new["policy"]["models"] == {**models, "n": {"rules": {}, "slo": {}}}
        validator.validate(new)
        wrong = {**new, "policy": {**new["policy"], "models": {"m": {"rules": {"max_output_tokenz": 9}}}}}
        assert not validator.is_valid(wrong)
        assert c.get("/v1/policy", headers=ADM).json() == new
    with TestClient(create_app(settings(db_url, policy_file=str(pol)))) as c:
        assert c.get("/v1/policy", headers=ADM).json()["version"] == new["version"]  # the file unchanged


def _migrated_engine(db_url: str) -> sa.Engine:
    open_store(db_url).close()
    return sa.create_engine(db_url)


def test_a_stream_worker_loads_only_the_commands_of_its_partitions_and_forgets_those_it_hands_on(db_url):
    """Two books on one store, as two stream workers: each keeps the commands whose home source (the
    engine, else the gateway) it holds; one that hands a source on forgets its commands, its next owner
    loads them, and neither drops a command from the store."""
    from ledger.rules.commands import CommandBook
    from ledger.rules.engine import Decision

    eng = _migrated_engine(db_url)
    decider = CommandBook(eng)
    decider.record(
        [
            Decision("r1", "loop", "abort", "d", "m", "e0", "g0", time.time()),
            Decision("r2", "loop", "abort", "d", "m", "e1", None, time.time()),
            Decision("r3", "loop", "abort", "d", "m", None, "g1", time.time()),
        ]
    )
    mine = {"e0", "g1"}
    worker = CommandBook(eng)
    worker.load(lambda sid: sid in mine)
    assert sorted(p.command.request_id for p in worker.by_id.values()) == ["r1", "r3"]
    assert worker.for_source("g0")[0].request_id == "r1"  # its gateway target comes with it
    worker.load(lambda sid: sid in mine)  # loading again adds nothing twice
    assert len(worker.by_id) == 2
    mine.discard("e0")
    assert worker.forget(lambda sid: sid in mine) == 1
    assert [p.command.request_id for p in worker.by_id.values()] == ["r3"]
    assert worker.for_source("e0") == [] and worker.for_source("g0") == []
    assert {r["state"] for r in cutoff_rows(db_url)} == {"pending"}
    eng.dispose()


def test_a_target_confirmed_to_another_worker_stops_being_sent_and_closes_the_command(db_url):
    """The decider re-sends to both targets; the gateway confirms to another worker (its partition's),
    which stores it: the decider's refresh stops re-sending to the gateway, and once the engine confirms
    too the command is applied, not left pending."""
    from ledger.rules.commands import CommandBook
    from ledger.rules.engine import Decision

    eng = _migrated_engine(db_url)
    decider, other = CommandBook(eng), CommandBook(eng)
    ((_, p),) = decider.record([Decision("r1", "loop", "abort", "d", "m", "e0", "g0", time.time())])
    assert other.confirm("g0", p.command.id, time.time()) is None  # not pending there: stored only
    assert decider.for_source("g0")  # not yet seen
    assert decider.refresh() == 0
    assert decider.for_source("g0") == [] and decider.for_source("e0")
    assert decider.confirm("e0", p.command.id, time.time()) is p
    (row,) = cutoff_rows(db_url)
    assert row["state"] == "applied" and row["applied_ts"] and row["gateway_applied_ts"]
    # a command closed in the store by another worker leaves memory at the next refresh
    ((_, q),) = decider.record([Decision("r2", "loop", "abort", "d", "m", "e0", None, time.time())])
    other.confirm("e0", q.command.id, time.time())
    with eng.begin() as conn:
        conn.execute(
            sa.text("UPDATE cutoffs SET state = 'applied' WHERE command_id = :id"), {"id": q.command.id}
        )
    decider.refresh()
    assert q.command.id not in decider.by_id
    eng.dispose()
