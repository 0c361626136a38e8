"""``POST /v1/events`` on both wires (JSON and the columnar message, ``Content-Type`` says which) and both
backends: the same traffic stores the same rows, and every ingest guarantee holds on the columnar wire
as on JSON (replay, out of order, all or nothing, a 422 naming the field, exactly once)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from bench import wire as traffic_gen
from engine_hooks import columnar
from engine_hooks import events as ev
from ledger.app import create_app
from ledger.config import Settings

JSON = "application/json"
WIRES: dict[str, tuple[Callable[[ev.Batch], bytes], str]] = {
    "json": (ev.batch_encoder.encode, JSON),
    "columns": (columnar.encode_batch, columnar.MEDIA_TYPE),
}
TABLES = ("events", "steps", "requests")


def _batches(seed: int = 7, steps_per_message: int = 5) -> list[ev.Batch]:
    """A small run with every kind in it, cut as an exporter cuts it (a few steps a message)."""
    t = traffic_gen.small_traffic(seed)
    seq, out = t.seq_start, []
    for entries in t.all_messages(steps_per_message):
        events, seq = traffic_gen.reference_events(entries, seq)
        out.append(ev.Batch(source=t.source, events=events))
    return out


@pytest.fixture(scope="module")
def batches() -> list[ev.Batch]:
    return _batches()


@pytest.fixture
def app_client(db_url: str) -> Iterator[Callable[[], TestClient]]:
    """Opens the ledger on ``db_url`` (again after a wipe: a fresh app, no memory of the last)."""
    opened: list[TestClient] = []

    def open_client() -> TestClient:
        for c in opened:
            c.__exit__(None, None, None)
        opened.clear()
        c = TestClient(
            create_app(Settings(db_url=db_url, max_events_per_batch=10_000)), base_url="http://127.0.0.1"
        )
        c.__enter__()
        opened.append(c)
        return c

    yield open_client
    for c in opened:
        c.__exit__(None, None, None)


def _send(client: TestClient, batch: ev.Batch, wire: str) -> Any:
    encode, media = WIRES[wire]
    return client.post("/v1/events", content=encode(batch), headers={"content-type": media})


def _snapshot(db_url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every stored row but the ingest time, in a stable order; a step's request keys as the ids they
    stand for (PostgreSQL's key sequence goes on after a wipe)."""
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            ids = dict(conn.exec_driver_sql("SELECT request_key, request_id FROM request_keys").all())
            out = {}
            for table in TABLES:
                names = conn.exec_driver_sql(f"SELECT * FROM {table} LIMIT 0").keys()
                kept = [n for n in names if n != "ingested_ts"]
                rows = conn.exec_driver_sql(f"SELECT {', '.join(kept)} FROM {table}").mappings().all()
                resolved = [
                    tuple([ids[k] for k in v] if n == "request_keys" and v else v for n, v in r.items())
                    for r in rows
                ]
                out[table] = sorted(resolved, key=repr)
            return out
    finally:
        engine.dispose()


def _wipe(db_url: str) -> None:
    engine = sa.create_engine(db_url)
    try:
        with engine.begin() as conn:
            tables = conn.exec_driver_sql(
                "SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE' "
                "AND table_schema IN ('main', 'public') AND table_name <> 'alembic_version'"
            ).all()
            for (table,) in tables:
                conn.exec_driver_sql(f"DELETE FROM {table}")
    finally:
        engine.dispose()


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_the_same_traffic_as_columns_stores_the_rows_json_stores(db_url, app_client, batches, order):
    sent = batches if order == "in order" else batches[::-1]
    client = app_client()
    for b in sent:
        assert _send(client, b, "json").json()["accepted"] == len(b.events)
    want = _snapshot(db_url)
    assert all(want[t] for t in TABLES)
    client.__exit__(None, None, None)
    _wipe(db_url)
    client = app_client()
    for b in sent:
        r = _send(client, b, "columns")
        assert r.status_code == 200, r.text
        assert r.json() == {"accepted": len(b.events), "duplicates": 0, "commands": r.json()["commands"]}
    assert _snapshot(db_url) == want


def test_a_message_sent_again_on_either_wire_is_all_duplicates(db_url, app_client, batches):
    client = app_client()
    first = batches[0]
    assert _send(client, first, "columns").json()["accepted"] == len(first.events)
    for wire in ("columns", "json"):
        assert _send(client, first, wire).json() == {
            "accepted": 0,
            "duplicates": len(first.events),
            "commands": [],
        }
    stored = _snapshot(db_url)
    assert len(stored["events"]) == len(first.events)


def test_a_message_that_changes_a_stored_step_is_a_409_naming_its_seq(db_url, app_client, batches):
    client = app_client()
    first = batches[0]
    assert _send(client, first, "columns").status_code == 200
    i, step = next((i, e) for i, e in enumerate(first.events) if type(e) is ev.Step)
    events = list(first.events)
    events[i] = msgspec.structs.replace(step, ts=step.ts - 1.0)
    r = _send(client, ev.Batch(source=first.source, events=events), "columns")
    assert r.status_code == 409 and r.json()["reason"] == "conflicting_replay"
    assert r.json()["seqs"] == [step.seq]


def _spoiled(batch: ev.Batch) -> tuple[ev.Batch, int]:
    """The batch with one step's token total below its new tokens; (batch, the step's index)."""
    i, step = next((i, e) for i, e in enumerate(batch.events) if type(e) is ev.Step and e.token_counts)
    totals = list(step.token_totals)
    totals[0] = step.token_counts[0] - 1
    events = list(batch.events)
    events[i] = msgspec.structs.replace(step, token_totals=totals)
    return ev.Batch(source=batch.source, events=events), i


def test_a_bad_message_is_a_422_naming_the_field_as_json_does_and_nothing_of_it_is_stored(
    db_url, app_client, batches
):
    client = app_client()
    bad, index = _spoiled(batches[1])
    answers = {wire: _send(client, bad, wire) for wire in WIRES}
    assert {w: r.status_code for w, r in answers.items()} == {"json": 422, "columns": 422}
    (got,), (want,) = answers["columns"].json()["errors"], answers["json"].json()["errors"]
    assert (got["index"], got["field"]) == (want["index"], want["field"]) == (index, "token_totals[0]")
    assert got["reason"].startswith(want["reason"])
    assert not any(_snapshot(db_url).values())
    assert _send(client, batches[1], "columns").json()["accepted"] == len(batches[1].events)


@pytest.mark.parametrize(
    "media",
    ["application/msgpack", "application/vnd.chunkledger.columns+arrow", "application/x-www-form-urlencoded"],
)
def test_a_body_type_the_ledger_cannot_read_is_a_415_naming_the_types_it_reads(
    db_url, app_client, batches, media
):
    client = app_client()
    r = client.post("/v1/events", content=columnar.encode_batch(batches[0]), headers={"content-type": media})
    assert r.status_code == 415 and r.json()["reason"] == "unsupported_media_type"
    assert columnar.MEDIA_TYPE in r.headers["accept-post"] and media in r.json()["detail"]
    assert not any(_snapshot(db_url).values())


def test_json_without_a_content_type_is_still_read(db_url, app_client, batches):
    client = app_client()
    body = ev.batch_encoder.encode(batches[0])
    assert client.post("/v1/events", content=body).json()["accepted"] == len(batches[0].events)


def test_a_media_type_with_parameters_and_another_case_is_read(db_url, app_client, batches):
    client = app_client()
    media = columnar.MEDIA_TYPE.upper() + "; charset=binary"
    r = client.post("/v1/events", content=columnar.encode_batch(batches[0]), headers={"content-type": media})
    assert r.json()["accepted"] == len(batches[0].events)


def test_a_message_stored_whole_folds_from_its_columns_and_a_partly_stored_one_from_its_events(
    db_url, app_client, batches, monkeypatch
):
    from ledger.store import base

    calls: list[str] = []
    columns_fold, steps_fold = base.fold_step_columns, base.fold_steps
    monkeypatch.setattr(base, "fold_step_columns", lambda *a: calls.append("columns") or columns_fold(*a))
    monkeypatch.setattr(base, "fold_steps", lambda *a: calls.append("events") or steps_fold(*a))
    client = app_client()
    first, second = batches[0], batches[1]
    assert _send(client, first, "columns").json()["accepted"] == len(first.events)
    assert calls == ["columns"]
    calls.clear()
    # the first message again with the second's events after it: its new part folds from its events
    both = ev.Batch(source=first.source, events=[*first.events, *second.events])
    assert _send(client, both, "columns").json() == {
        "accepted": len(second.events),
        "duplicates": len(first.events),
        "commands": [],
    }
    assert calls == ["events"]


def test_a_step_stamped_far_ahead_is_stored_with_the_receive_time_on_the_columns_wire_too(
    db_url, app_client, batches
):
    """The clamp changes the events, not the message's columns: the store folds the clamped events."""
    import time

    client = app_client()
    first = batches[0]
    i, step = next((i, e) for i, e in enumerate(first.events) if type(e) is ev.Step and e.request_ids)
    events = list(first.events)
    events[i] = msgspec.structs.replace(step, ts=time.time() + 3600)
    assert _send(client, ev.Batch(source=first.source, events=events), "columns").status_code == 200
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        latest = conn.exec_driver_sql("SELECT max(last_step_ts), max(last_token_ts) FROM requests").one()
    engine.dispose()
    assert all(t is not None and t < time.time() + 60 for t in latest), latest
