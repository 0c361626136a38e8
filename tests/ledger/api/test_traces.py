"""Trace context on the ledger's rows: stored from the gateway's or the engine's events, shown by
``GET /v1/requests/{id}`` (with a trace UI link when one is configured), joinable in SQL."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from pydantic import ValidationError

from engine_hooks import events as ev
from ledger.app import create_app
from ledger.config import Settings
from tests.support.factories import ENGINE, GATEWAY, body, lifecycle, numbered

TOKENS = {"ingest_token": "ing", "read_token": "rd", "admin_token": "adm"}
ING = {"Authorization": "Bearer ing", "content-type": "application/json"}
RD = {"Authorization": "Bearer rd"}
TRACE, CALLER, GATEWAY_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "b7ad6b7169203331"
TRACE_UI = "http://jaeger.example:16686/trace/{trace_id}"


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    app = create_app(Settings(db_url=db_url, trace_url=TRACE_UI, **TOKENS))
    with TestClient(app) as c:
        yield c


def _traced(rid: str) -> tuple[list, list]:
    gw, en = lifecycle(rid)
    arrived = msgspec.structs.replace(gw[0], trace_id=TRACE, parent_span_id=CALLER, span_id=GATEWAY_SPAN)
    return [arrived, *gw[1:]], en


def test_the_gateways_trace_is_on_the_row_with_a_link_and_sql_joins_on_it(client, db_url):
    gw, en = _traced("t1")
    assert client.post("/v1/events", content=body(GATEWAY, numbered(gw)), headers=ING).status_code == 200
    assert client.post("/v1/events", content=body(ENGINE, numbered(en)), headers=ING).status_code == 200
    doc = client.get("/v1/requests/t1", headers=RD).json()
    row = doc["request"]
    assert (row["trace_id"], row["parent_span_id"], row["span_id"]) == (TRACE, CALLER, GATEWAY_SPAN)
    assert doc["trace_url"] == f"http://jaeger.example:16686/trace/{TRACE}"
    spans = f"SELECT '{TRACE}' AS trace_id, 'llm_request' AS name"  # as a trace backend's table would hold
    sql = f"SELECT r.request_id, s.name FROM requests r JOIN ({spans}) s ON s.trace_id = r.trace_id"
    assert _sql(client, db_url, sql) == [["t1", "llm_request"]]


def _sql(client: TestClient, db_url: str, sql: str) -> list[list]:
    """Through /v1/sql on DuckDB; PostgreSQL's /v1/sql needs a read-only role, so its database directly."""
    if not db_url.startswith("postgresql"):
        answer = client.post("/v1/sql", json={"sql": sql}, headers=RD)
        assert answer.status_code == 200, answer.text
        return answer.json()["rows"]
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            return [list(r) for r in conn.exec_driver_sql(sql).all()]
    finally:
        engine.dispose()


def test_without_a_gateway_the_engines_context_is_the_rows(client):
    events = numbered(
        [ev.Queued(seq=0, ts=5.0, request_id="e1", prompt_tokens=3, trace_id=TRACE, parent_span_id=CALLER)]
    )
    assert client.post("/v1/events", content=body(ENGINE, events), headers=ING).status_code == 200
    doc = client.get("/v1/requests/e1", headers=RD).json()
    assert (doc["request"]["trace_id"], doc["request"]["parent_span_id"], doc["request"]["span_id"]) == (
        TRACE,
        CALLER,
        None,
    )


def test_an_untraced_request_has_no_link(client):
    gw, _ = lifecycle("u1")
    client.post("/v1/events", content=body(GATEWAY, numbered(gw)), headers=ING)
    doc = client.get("/v1/requests/u1", headers=RD).json()
    assert doc["request"]["trace_id"] is None and doc["trace_url"] is None


def test_a_trace_id_that_is_not_w3c_is_a_422_naming_the_field(client):
    gw, _ = lifecycle("bad")
    raw = msgspec.json.decode(body(GATEWAY, numbered(gw)))
    raw["events"][0]["trace_id"] = "0" * 32
    r = client.post("/v1/events", content=msgspec.json.encode(raw), headers=ING)
    assert r.status_code == 422
    assert [(e["index"], e["field"]) for e in r.json()["errors"]] == [(0, "trace_id")]


@pytest.mark.parametrize("url", ["jaeger:16686/trace/{trace_id}", "http://jaeger:16686/trace/"])
def test_a_trace_url_without_a_scheme_or_the_placeholder_is_refused(url):
    with pytest.raises(ValidationError, match="trace_url"):
        Settings(trace_url=url)
