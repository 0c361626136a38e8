"""The API's contract, read off its OpenAPI document and checked against its answers.

* every operation names a response schema for its 2xx answer, and the one error body (``reason`` and a
  string ``detail``) for each 4xx/5xx it documents; every operation is tagged;
* a sample of bad requests (bad query parameter, missing request, bad body, no or a wrong token, wrong
  method) each gets that error body, at a status its operation documents, and never a 5xx.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ledger.app import create_app
from ledger.client import error_from
from ledger.config import Settings

TOKENS = {"ingest_token": "ing", "read_token": "rd", "admin_token": "adm"}
ING = {"Authorization": "Bearer ing"}
RD = {"Authorization": "Bearer rd"}
ADM = {"Authorization": "Bearer adm"}
TAGS = {"ingest", "requests", "analytics", "rules", "webhooks", "sql", "advice", "whatif", "health"}
REASON = re.compile(r"^[a-z][a-z0-9_]*$")


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    db = Path(tmp_path_factory.mktemp("contract")) / "ledger.duckdb"
    app = create_app(Settings(db_url=f"duckdb:///{db}", **TOKENS))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def doc(client: TestClient) -> dict[str, Any]:
    r = client.get("/openapi.json")
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


def _operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            yield method, path, op


def _resolve(doc: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    name = ref.removeprefix("#/components/schemas/")
    assert name in doc["components"]["schemas"], ref
    return doc["components"]["schemas"][name]  # type: ignore[no-any-return]


def test_every_route_is_documented(client, doc):
    documented = {(m.upper(), p) for m, p, _ in _operations(doc)}
    served = {
        (method, route.path)
        for route in client.app.routes
        if getattr(route, "include_in_schema", False)
        for method in getattr(route, "methods", ()) - {"HEAD"}
    }
    assert served == documented
    assert len(documented) >= 23
    assert {p for _, p in documented if not p.startswith("/v1/")} == {"/healthz", "/readyz", "/metrics"}


def test_every_operation_names_its_2xx_schema_and_the_error_body_for_its_errors(doc):
    assert "HTTPValidationError" not in doc["components"]["schemas"]  # no second error shape
    for method, path, op in _operations(doc):
        where = f"{method.upper()} {path}"
        assert op.get("tags") and set(op["tags"]) <= TAGS, where
        responses = op["responses"]
        ok = [code for code in responses if code.startswith("2")]
        assert ok, where
        for code in ok:
            content = responses[code].get("content")
            assert content, f"{where} {code}: no media type"
            for media, spec in content.items():
                schema = spec.get("schema")
                assert schema, f"{where} {code} {media}: no schema"
                if media == "application/json":
                    assert "$ref" in schema, f"{where} {code}: the JSON answer names no model"
                    assert _resolve(doc, schema).get("properties"), f"{where} {code}: an empty model"
        errors = [code for code in responses if code[0] in "45"]
        for code in errors:
            schema = responses[code]["content"]["application/json"]["schema"]
            assert "$ref" in schema, f"{where} {code}"
            body = _resolve(doc, schema)
            assert {"reason", "detail"} <= set(body.get("required", [])), f"{where} {code}"
            assert body["properties"]["reason"]["type"] == "string", f"{where} {code}"
            assert body["properties"]["detail"]["type"] == "string", f"{where} {code}"
        if op.get("parameters") or op.get("requestBody"):
            assert "422" in responses, f"{where}: takes input, documents no 422"
        if path.startswith("/v1/") or path == "/metrics":
            assert {"401", "403"} <= set(responses), f"{where}: behind a token, documents no 401/403"


def test_binary_and_text_answers_name_their_media_type(doc):
    export = doc["paths"]["/v1/export/{table}.parquet"]["get"]["responses"]["200"]["content"]
    assert export["application/vnd.apache.parquet"]["schema"] == {"type": "string", "format": "binary"}
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert [m for m in metrics if m.startswith("text/plain")]
    sql = doc["paths"]["/v1/sql"]["post"]["responses"]["200"]["content"]
    assert {"application/json", "text/csv"} <= set(sql)


def test_large_answers_are_documented_but_not_validated_per_request(client):
    """The hot and large routes keep ``response_model=None``: their models are in the document only."""
    large = {
        ("POST", "/v1/events"),
        ("GET", "/v1/requests/{request_id}"),
        ("GET", "/v1/attribution"),
        ("GET", "/v1/requests"),
        ("GET", "/v1/itl"),
        ("GET", "/v1/requests/{request_id}/itl"),
        ("GET", "/v1/requests/{request_id}/why"),
        ("GET", "/v1/kv/stalls"),
        ("GET", "/v1/engines"),
        ("GET", "/v1/cutoffs"),
        ("GET", "/v1/commands"),
        ("GET", "/v1/webhooks/deliveries"),
        ("POST", "/v1/sql"),
        ("GET", "/v1/export/{table}.parquet"),
        ("GET", "/v1/advice/chunk-size"),
    }
    seen = set()
    for route in client.app.routes:
        for method in getattr(route, "methods", ()):
            if (method, getattr(route, "path", "")) in large:
                assert route.response_model is None, (method, route.path)  # type: ignore[attr-defined]
                seen.add((method, route.path))  # type: ignore[attr-defined]
    assert seen == large


RD_JSON = {**RD, "content-type": "application/json"}
BAD_SOURCE = b'{"source": {"id": "s", "kind": "nope"}, "events": []}'

# (method, path, kwargs, status, reason): one sample per kind of mistake, on most routes.
BAD = [
    # a bad query or path parameter: FastAPI's validation, and the routes' own checks
    ("GET", "/v1/requests", {"params": {"limit": 0}, "headers": RD}, 422, "invalid"),
    ("GET", "/v1/requests", {"params": {"sort": "nope"}, "headers": RD}, 422, "invalid"),
    ("GET", "/v1/attribution", {"params": {"since": "yesterday-ish"}, "headers": RD}, 422, "invalid"),
    ("GET", "/v1/itl", {"params": {"by_model": "maybe"}, "headers": RD}, 422, "invalid"),
    ("GET", "/v1/kv/stalls", {"params": {"horizon_s": -1}, "headers": RD}, 422, "invalid"),
    ("GET", "/v1/engines", {"params": {"top": 500}, "headers": RD}, 422, "invalid"),
    ("GET", "/v1/requests/r1/why", {"params": {"top": 99}, "headers": RD}, 422, "invalid"),
    ("GET", "/v1/cutoffs", {"params": {"state": "bogus"}, "headers": RD}, 422, "invalid"),
    ("GET", "/v1/commands", {"params": {"wait_s": 0}, "headers": ING}, 422, "invalid"),  # no source_id
    ("GET", "/v1/advice/chunk-size", {"headers": RD}, 422, "invalid"),
    ("GET", "/v1/webhooks/deliveries", {"params": {"limit": 5000}, "headers": ADM}, 422, "invalid"),
    ("GET", "/v1/export/steps.parquet", {"params": {"since": "soon"}, "headers": RD}, 400, "bad_time"),
    # a missing request or thing
    ("GET", "/v1/requests/nope", {"headers": RD}, 404, "not_found"),
    ("GET", "/v1/requests/nope/itl", {"headers": RD}, 404, "not_found"),
    ("GET", "/v1/requests/nope/why", {"headers": RD}, 404, "not_found"),
    ("DELETE", "/v1/webhooks/nope", {"headers": ADM}, 404, "not_found"),
    ("GET", "/v1/export/users.parquet", {"headers": RD}, 404, "not_found"),
    ("GET", "/v1/nothing-here", {"headers": RD}, 404, "not_found"),
    # a bad body
    ("POST", "/v1/sql", {"json": {"sql": ""}, "headers": RD}, 422, "invalid"),
    ("POST", "/v1/sql", {"json": {"sql": "SELECT 1", "nope": 1}, "headers": RD}, 422, "invalid"),
    ("POST", "/v1/sql", {"headers": RD}, 422, "invalid"),
    ("POST", "/v1/sql", {"content": b"{not json", "headers": RD_JSON}, 422, "invalid"),
    ("POST", "/v1/sql", {"json": {"sql": "DELETE FROM requests"}, "headers": RD}, 400, "not_read_only"),
    ("PUT", "/v1/policy", {"content": b"{", "headers": ADM}, 422, "invalid"),
    ("PUT", "/v1/policy", {"json": {"rules": {"nope": 1}}, "headers": ADM}, 422, "invalid"),
    ("POST", "/v1/webhooks", {"json": {"url": "http://x"}, "headers": ADM}, 422, "invalid"),
    ("POST", "/v1/events", {"content": BAD_SOURCE, "headers": ING}, 422, "invalid"),
    # no token, an unknown one, another role's
    ("GET", "/v1/sources", {}, 401, "missing_token"),
    ("GET", "/v1/requests/r1", {"headers": {"Authorization": "Bearer wrong"}}, 401, "unknown_token"),
    ("POST", "/v1/events", {"content": b"{}"}, 401, "missing_token"),
    ("GET", "/v1/policy", {"headers": RD}, 403, "forbidden"),
    ("GET", "/v1/webhooks", {"headers": ING}, 403, "forbidden"),
    ("GET", "/v1/attribution", {"headers": ING}, 403, "forbidden"),
    ("GET", "/metrics", {}, 401, "missing_token"),
    # a method the path does not take
    ("DELETE", "/v1/sources", {"headers": RD}, 405, "method_not_allowed"),
]  # fmt: skip


def _operation(doc: dict[str, Any], method: str, path: str) -> dict[str, Any] | None:
    for template, item in doc["paths"].items():
        pattern = "^" + re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, path) and method.lower() in item:
            return item[method.lower()]  # type: ignore[no-any-return]
    return None


@pytest.mark.parametrize(("method", "path", "kw", "status", "reason"), BAD)
def test_a_bad_request_gets_the_one_error_body(client, doc, method, path, kw, status, reason):
    r = client.request(method, path, **kw)
    assert r.status_code < 500, r.text
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) <= {"reason", "detail", "errors"}, body
    assert body["reason"] == reason and REASON.match(body["reason"]), body
    assert isinstance(body["detail"], str) and body["detail"], body
    if "errors" in body:
        assert isinstance(body["errors"], list) and body["errors"], body
    op = _operation(doc, method, path)
    if op is not None:  # an unknown path or method has no operation to document it
        assert str(status) in op["responses"], f"{method} {path}: {status} is not documented"
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"


def test_validation_errors_name_each_field_without_its_place_and_keep_fastapis_list(client):
    r = client.get("/v1/requests", params={"limit": 0, "offset": -1}, headers=RD)
    body = r.json()
    assert body["reason"] == "invalid"
    assert [e["loc"] for e in body["errors"]] == [["query", "limit"], ["query", "offset"]]
    fields = [part.split(":")[0] for part in body["detail"].split("; ")]
    assert fields == ["limit", "offset"], body["detail"]
    missing = client.post("/v1/sql", headers=RD).json()
    assert missing["detail"] == "body: Field required", missing
    not_json = client.post("/v1/sql", content=b"{", headers={**RD, "content-type": "application/json"})
    assert not_json.json()["detail"].startswith("body: JSON decode error"), not_json.text
    nested = client.post("/v1/sql", json={"sql": "SELECT 1", "max_rows": 0}, headers=RD).json()
    assert nested["detail"].startswith("max_rows: "), nested


def test_a_refused_batch_lists_each_field_and_keeps_its_detail(client):
    body = b'{"source": {"id": "s", "kind": "engine"}, "events": [{"kind": "nope"}]}'
    r = client.post("/v1/events", content=body, headers={**ING, "content-type": "application/json"})
    out = r.json()
    assert r.status_code == 422 and out["reason"] == "invalid"
    assert out["detail"] == "batch rejected, nothing stored"
    assert out["errors"] and {"index", "field", "reason"} <= set(out["errors"][0])


def test_the_client_reads_reason_detail_and_errors():
    req = httpx.Request("GET", "http://ledger/v1/requests")
    answer = {
        "reason": "invalid",
        "detail": "limit: Input should be greater than or equal to 1",
        "errors": [{"loc": ["query", "limit"], "msg": "Input should be greater than or equal to 1"}],
    }
    err = error_from(httpx.Response(422, json=answer, request=req))
    assert (err.label, err.detail, err.errors) == ("422 invalid", answer["detail"], answer["errors"])
    batch = {"reason": "invalid", "detail": "batch rejected, nothing stored", "errors": [{"index": 0}]}
    assert error_from(httpx.Response(422, json=batch, request=req)).errors == [{"index": 0}]
    old = {"detail": [{"loc": ["query", "limit"], "msg": "too small"}]}  # FastAPI's own shape
    err = error_from(httpx.Response(422, json=old, request=req))
    assert err.detail == "limit: too small" and err.errors == old["detail"] and err.reason is None
    assert (
        error_from(httpx.Response(404, json={"reason": "not_found", "detail": "x"}, request=req)).errors
        is None
    )


def test_a_server_error_and_not_ready_answer_with_the_error_body_too(client, monkeypatch):
    store = client.app.state.store

    def broken(*a: object, **kw: object) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(store, "source_rows", broken)
    r = client.get("/v1/sources", headers=RD)
    assert r.status_code == 500
    assert r.json() == {"reason": "internal", "detail": "internal error: the ledger's log has the details"}
    monkeypatch.setattr(store, "ping", broken)
    r = client.get("/readyz")
    body = r.json()
    assert r.status_code == 503 and body["reason"] == "not_ready" and body["status"] == "not ready"
    assert body["problems"] == ["database: RuntimeError: disk on fire"]
    assert body["detail"] == "not ready: database: RuntimeError: disk on fire" and "schema" in body
