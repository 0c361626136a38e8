"""Issue 35, items 5 and 6: a source's events and commands belong to its producer (attack replays on a
real server, both backends).

The victim and the attacker both hold the ingest token (the server runs open on loopback); only the
victim's exporter holds the victim's producer key (``engine_hooks.events.PRODUCER_HEADER``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from engine_hooks import events as ev
from engine_hooks.config import ExporterConfig
from engine_hooks.exporter import Exporter
from tests.support.servers import LedgerServer, served_ledger

LEASE_S = 2.0
MODEL = "owned-model"  # the policy caps its output at 4 tokens: a request past that gets a command


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def ledger(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LedgerServer]:
    pg = request.getfixturevalue("pg_database") if request.param == "postgres" else None
    env = {"CHUNKLEDGER_PRODUCER_LEASE_S": str(LEASE_S)}
    with served_ledger(request.param, pg, Path(tmp_path_factory.mktemp("own")), env) as server:
        policy = {"models": {MODEL: {"rules": {"max_output_tokens": 4}}}}
        httpx.put(f"{server.url}/v1/policy", json=policy, timeout=10).raise_for_status()
        yield server


def _post(
    server: LedgerServer, sid: str, events: list, key: str | None, kind: str = "engine"
) -> httpx.Response:
    src = ev.Source(id=sid, kind=kind, model=MODEL)  # type: ignore[arg-type]
    headers = {ev.PRODUCER_HEADER: key} if key else {}
    return httpx.post(
        f"{server.url}/v1/events", content=ev.encode_batch(src, events), headers=headers, timeout=30
    )


def _queued(seq: int, rid: str, ts: float | None = None) -> ev.Queued:
    return ev.Queued(seq=seq, ts=ts or time.time(), request_id=rid, prompt_tokens=5)


def _rejections(server: LedgerServer, reason: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'chunkledger_ingest_rejections_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_another_producer_cannot_write_under_a_bound_source_id_and_the_owners_events_are_kept(ledger):
    sid = f"victim-{time.monotonic_ns()}"
    assert _post(ledger, sid, [_queued(s, f"{sid}-r{s}") for s in (1, 2, 3)], "victim-key").status_code == 200
    fenced = _rejections(ledger, "fenced")
    for key in ("attacker-key", None):  # another key, or none (an exporter of an older version)
        r = _post(ledger, sid, [_queued(s, f"{sid}-x{s}") for s in (4, 5)], key)
        assert r.status_code == 409
        assert r.json()["reason"] == "fenced" and "source.id" in r.json()["detail"]
        assert 0 < int(r.headers["retry-after"]) <= LEASE_S
    assert _rejections(ledger, "fenced") == fenced + 2
    # the victim's real seq 4-7 are all new (they were "duplicates" of the attacker's before)
    r = _post(ledger, sid, [_queued(s, f"{sid}-r{s}") for s in (4, 5, 6, 7)], "victim-key")
    assert r.json() == {"accepted": 4, "duplicates": 0, "commands": []}
    assert httpx.get(f"{ledger.url}/v1/requests/{sid}-x4", timeout=10).status_code == 404


def test_a_conflicting_replay_is_a_409_naming_the_seq_counted_and_the_rest_is_stored(ledger):
    sid = f"replay-{time.monotonic_ns()}"
    t = time.time()
    first = [_queued(1, f"{sid}-a", t), _queued(2, f"{sid}-b", t)]
    assert _post(ledger, sid, first, "k").json()["accepted"] == 2
    assert _post(ledger, sid, first, "k").json()["duplicates"] == 2  # the same events: a retry
    before = _rejections(ledger, "conflicting_replay")
    r = _post(ledger, sid, [first[0], _queued(2, f"{sid}-other", t), _queued(3, f"{sid}-c", t)], "k")
    assert r.status_code == 409
    answer = r.json()
    assert answer["reason"] == "conflicting_replay" and answer["seqs"] == [2]
    assert "seq 2" in answer["detail"]
    assert (answer["accepted"], answer["duplicates"]) == (1, 1)
    assert _rejections(ledger, "conflicting_replay") == before + 1
    assert httpx.get(f"{ledger.url}/v1/requests/{sid}-other", timeout=10).status_code == 404
    assert httpx.get(f"{ledger.url}/v1/requests/{sid}-c", timeout=10).status_code == 200


def _request(server: LedgerServer, rid: str) -> dict:
    r = httpx.get(f"{server.url}/v1/requests/{rid}", timeout=10)
    assert r.status_code == 200, r.text
    return {**r.json()["request"], "events": r.json()["events"]}


def test_another_engine_cannot_rewrite_finish_or_feed_the_rules_of_a_request_it_does_not_serve(ledger):
    """A ``finished`` under a victim's request id set its model and output tokens, and its ``tokens``
    went to the victim's rules (whose cutoff then went to the attacker): now a 409 naming the id."""
    victim, attacker = f"v-{time.monotonic_ns()}", f"a-{time.monotonic_ns()}"
    rid = f"{victim}-req"
    t = time.time()
    r = _post(
        ledger,
        victim,
        [_queued(1, rid, t), ev.Tokens(seq=2, ts=t + 0.1, request_id=rid, count=2, total=2)],
        "vk",
    )
    assert r.json()["accepted"] == 2
    before = _rejections(ledger, "not_request_owner")
    evil = [
        ev.Tokens(seq=1, ts=t + 0.2, request_id=rid, count=50, total=50),
        _queued(2, f"{attacker}-own", t),
        ev.Finished(seq=3, ts=t + 0.3, request_id=rid, reason="stop", output_tokens=999_999),
    ]
    src = ev.Source(id=attacker, kind="engine", model="zzz-model")
    r = httpx.post(
        f"{ledger.url}/v1/events",
        content=ev.encode_batch(src, evil),
        headers={ev.PRODUCER_HEADER: "ak"},
        timeout=30,
    )
    assert r.status_code == 409, r.text
    answer = r.json()
    assert answer["reason"] == "not_request_owner" and answer["request_ids"] == [rid]
    assert rid in answer["detail"] and (answer["accepted"], answer["duplicates"]) == (1, 0)
    assert _rejections(ledger, "not_request_owner") == before + 1
    row = _request(ledger, rid)
    assert (row["model"], row["engine_source_id"], row["output_tokens"]) == (MODEL, victim, 2)
    assert row["finished_ts"] is None and row["finish_reason"] is None
    assert {e["source_id"] for e in row["events"]} == {victim}
    assert _request(ledger, f"{attacker}-own")["engine_source_id"] == attacker
    # The victim's own rules still run: past its cap of 4 tokens its request gets the command.
    r = _post(ledger, victim, [ev.Tokens(seq=3, ts=t + 0.4, request_id=rid, count=3, total=5)], "vk")
    assert r.status_code == 200
    deadline = time.monotonic() + 10
    commands = r.json()["commands"]
    while not commands and time.monotonic() < deadline:
        time.sleep(0.2)
        commands = _poll(ledger, victim, "vk").json()["commands"]
    assert [c["request_id"] for c in commands] == [rid]
    r = _post(
        ledger, victim, [ev.Finished(seq=4, ts=t + 0.5, request_id=rid, reason="stop", output_tokens=5)], "vk"
    )
    assert r.status_code == 200
    row = _request(ledger, rid)
    assert (row["finish_reason"], row["output_tokens"]) == ("stop", 5)


def test_a_gateway_and_an_engine_both_serve_a_request_and_a_second_gateway_or_a_step_cannot_join(ledger):
    gw, engine, other = (f"{n}-{time.monotonic_ns()}" for n in ("gw", "eng", "gw2"))
    rid = f"{gw}-req"
    t = time.time()
    assert _post(ledger, gw, [ev.Arrived(seq=1, ts=t, request_id=rid)], "gk", "gateway").status_code == 200
    assert _post(ledger, engine, [_queued(1, rid, t + 0.01)], "ek").status_code == 200
    r = _post(
        ledger, other, [ev.Completed(seq=1, ts=t + 1, request_id=rid, status_code=500)], "ok", "gateway"
    )
    assert r.status_code == 409 and r.json()["request_ids"] == [rid]
    # a step of another engine naming the request (its idle time, its participation) is refused whole
    step = ev.Step(seq=1, ts=t + 0.5, step=1, duration_s=0.01, request_ids=[], stalled_request_ids=[rid])
    r = _post(ledger, f"{engine}-x", [step], "xk")
    assert r.status_code == 409 and r.json()["request_ids"] == [rid]
    row = _request(ledger, rid)
    assert (row["gateway_source_id"], row["engine_source_id"]) == (gw, engine)
    assert row["status_code"] is None and row["stalled_steps"] == 0


def test_a_retried_event_the_ledger_clamped_to_its_receive_time_is_a_duplicate(ledger):
    sid = f"clamp-{time.monotonic_ns()}"
    batch = [_queued(1, f"{sid}-a", time.time() + 100_000)]  # stamped a day ahead: stored at receive time
    assert _post(ledger, sid, batch, "k").json()["accepted"] == 1
    time.sleep(0.01)
    assert _post(ledger, sid, batch, "k").json() == {"accepted": 0, "duplicates": 1, "commands": []}


def _command_for(server: LedgerServer, sid: str, key: str) -> ev.Command:
    rid = f"{sid}-runaway"
    t = time.time()
    events = [_queued(1, rid, t), ev.Tokens(seq=2, ts=t + 0.1, request_id=rid, count=10, total=10)]
    commands = _post(server, sid, events, key).json()["commands"]
    if not commands:  # decided on arrival, maybe just after the answer: the next poll has it
        commands = _poll(server, sid, key, wait_s=5).json()["commands"]
    assert commands
    return msgspec.convert(commands[0], ev.Command)


def _poll(server: LedgerServer, sid: str, key: str | None, wait_s: float = 0) -> httpx.Response:
    headers = {ev.PRODUCER_HEADER: key} if key else {}
    params = {"source_id": sid, "wait_s": wait_s}
    return httpx.get(f"{server.url}/v1/commands", params=params, headers=headers, timeout=30)


def test_only_the_sources_producer_can_read_its_commands(ledger):
    sid = f"cmd-victim-{time.monotonic_ns()}"
    cmd = _command_for(ledger, sid, "victim-key")
    for key in ("attacker-key", None):
        r = _poll(ledger, sid, key)
        assert r.status_code == 403 and r.json()["reason"] == "not_source_owner"
        assert cmd.id not in r.text
    assert [c["id"] for c in _poll(ledger, sid, "victim-key").json()["commands"]] == [cmd.id]


def test_a_confirmation_from_another_source_does_not_apply_the_command(ledger):
    sid = f"confirm-victim-{time.monotonic_ns()}"
    cmd = _command_for(ledger, sid, "victim-key")
    fake = ev.CutoffApplied(
        seq=1, ts=time.time(), request_id=cmd.request_id, command_id=cmd.id, action=cmd.action, rule=cmd.rule
    )
    r = _post(ledger, f"{sid}-attacker", [fake], "attacker-key")
    assert r.status_code == 409 and r.json()["request_ids"] == [cmd.request_id]  # not its request
    time.sleep(0.3)  # confirmations are recorded beside the rule engine's intake
    rows = httpx.get(f"{ledger.url}/v1/cutoffs", params={"request_id": cmd.request_id}, timeout=10).json()
    assert [(c["state"], c["applied_ts"]) for c in rows["cutoffs"]] == [("pending", None)]
    # the victim still gets it, and its own confirmation applies it
    assert [c["id"] for c in _poll(ledger, sid, "victim-key").json()["commands"]] == [cmd.id]
    mine = msgspec.structs.replace(fake, seq=3)
    assert _post(ledger, sid, [mine], "victim-key").status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = httpx.get(f"{ledger.url}/v1/cutoffs", params={"request_id": cmd.request_id}, timeout=10).json()
        if rows["cutoffs"][0]["state"] == "applied":
            break
        time.sleep(0.1)
    assert rows["cutoffs"][0]["state"] == "applied"


def test_an_exporter_fenced_by_another_producer_keeps_its_events_and_delivers_them_once_the_binding_lapses(
    ledger, tmp_path
):
    sid = f"late-owner-{time.monotonic_ns()}"
    # Someone else (a producer that then stopped) holds the id when the exporter starts.
    assert _post(ledger, sid, [_queued(1, f"{sid}-old")], "stopped-key").status_code == 200
    config = ExporterConfig(
        url=ledger.url,
        source_id=sid,
        source_kind="engine",
        model=MODEL,
        spool_dir=str(tmp_path),
        batch_size=10,
    )
    exporter = Exporter(config)
    try:
        queued = exporter.emitter(ev.Queued, "request_id", "prompt_tokens")
        for i in range(5):
            queued(f"{sid}-new{i}", 5)
        assert exporter.force_flush(timeout=LEASE_S + 15)
        stats = exporter.stats()
        assert stats.send_failures >= 1 and not stats.dropped  # fenced first, then delivered, nothing lost
    finally:
        exporter.shutdown()
    for i in range(5):
        assert httpx.get(f"{ledger.url}/v1/requests/{sid}-new{i}", timeout=10).status_code == 200


def test_a_restarted_exporter_with_its_spool_is_the_same_producer(ledger, tmp_path):
    sid = f"restart-{time.monotonic_ns()}"
    config = ExporterConfig(
        url=ledger.url, source_id=sid, source_kind="engine", model=MODEL, spool_dir=str(tmp_path)
    )
    first = Exporter(config)
    first.emitter(ev.Queued, "request_id", "prompt_tokens")(f"{sid}-a", 5)
    assert first.force_flush(timeout=10)
    first.shutdown()
    second = Exporter(config)  # at once, well within the lease
    try:
        second.emitter(ev.Queued, "request_id", "prompt_tokens")(f"{sid}-b", 5)
        assert second.force_flush(timeout=10)
        assert second.stats().send_failures == 0
    finally:
        second.shutdown()


def test_only_a_sources_own_producer_can_release_it_and_then_another_takes_it_at_once(ledger):
    sid = f"release-{time.monotonic_ns()}"
    assert _post(ledger, sid, [_queued(1, f"{sid}-a")], "owner-key").status_code == 200
    url = f"{ledger.url}/v1/sources/{sid}/producer"
    r = httpx.delete(url, headers={ev.PRODUCER_HEADER: "other-key"}, timeout=10)
    assert r.status_code == 409 and r.json()["reason"] == "not_source_owner"
    r = httpx.delete(url, timeout=10)
    assert r.status_code == 422 and ev.PRODUCER_HEADER in r.json()["detail"]
    assert _post(ledger, sid, [_queued(2, f"{sid}-b")], "other-key").status_code == 409  # still bound
    r = httpx.delete(url, headers={ev.PRODUCER_HEADER: "owner-key"}, timeout=10)
    assert r.status_code == 200 and r.json() == {"source_id": sid, "released": True}
    assert _post(ledger, sid, [_queued(2, f"{sid}-b")], "other-key").status_code == 200
    assert httpx.get(f"{ledger.url}/v1/requests/{sid}-b", timeout=10).status_code == 200


def test_an_exporter_that_stops_cleanly_hands_its_source_id_to_a_successor_without_its_spool(
    ledger, tmp_path
):
    sid = f"handover-{time.monotonic_ns()}"

    def config(spool: str) -> ExporterConfig:
        return ExporterConfig(
            url=ledger.url, source_id=sid, source_kind="engine", model=MODEL, spool_dir=str(tmp_path / spool)
        )

    first = Exporter(config("first"))
    first.emitter(ev.Queued, "request_id", "prompt_tokens")(f"{sid}-a", 5)
    assert first.force_flush(timeout=10)
    assert first.shutdown()
    second = Exporter(config("second"))  # another spool folder: another key, as a pod restarted elsewhere
    try:
        second.emitter(ev.Queued, "request_id", "prompt_tokens")(f"{sid}-b", 5)
        assert second.force_flush(timeout=10)
        assert second.stats().send_failures == 0  # not fenced: the id was released, no lease to wait out
    finally:
        second.shutdown()
    assert httpx.get(f"{ledger.url}/v1/requests/{sid}-b", timeout=10).status_code == 200
