"""Every route's real answers, checked against the schema the OpenAPI document publishes for them.

A ledger holds real traffic (the fleet simulator's engine through a real ``chunkledger serve``, then a
stuck request, a policy, webhook subscriptions and a delivery through the app); every route of the app
is called (the cases are keyed by the app's own routes, so a new route without a case fails), and each
answer, 2xx and documented 4xx, is validated with a JSON-Schema validator against its operation's
schema for that status. The schemas must be strict: an answer with a field its schema does not name, or
without one it requires, fails.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from engine_hooks import events as ev
from engine_hooks.simulation.scenario import SCENARIOS
from engine_hooks.simulator import run_simulation
from ledger.app import create_app
from ledger.config import Settings
from tests.support.servers import LedgerServer, free_port

TOKENS = {"ingest_token": "ing", "read_token": "rd", "admin_token": "adm"}
ING = {"Authorization": "Bearer ing"}
RD = {"Authorization": "Bearer rd"}
ADM = {"Authorization": "Bearer adm"}
KEY = {ev.PRODUCER_HEADER: "contract-producer-key"}
BAD_SOURCE = b'{"source": {"id": "s", "kind": "x"}, "events": []}'
SIM = "sim-llama"
STUCK = ev.Source(id="stuck-engine", kind="engine", model="stuck-model")

# the simulated engine's settings (kv-pressure: 2,048 blocks), which what-if cannot read off its steps
WHATIF = {
    "model": SIM,
    "set": "max_num_batched_tokens=512",
    "recorded": "num_kv_blocks=2048,max_num_seqs=256,reserve_full_isl=false",
}

# (method, route path) -> the calls made of it: (path with {rid}/{sub}, request kwargs, expected status)
Case = tuple[str, dict[str, Any], int]
CASES: dict[tuple[str, str], list[Case]] = {
    ("GET", "/healthz"): [("/healthz", {}, 200)],
    ("GET", "/readyz"): [("/readyz", {}, 200)],
    ("POST", "/v1/events"): [
        ("/v1/events", {"content": "{batch}", "headers": {**ING, **KEY}}, 200),
        ("/v1/events", {"content": BAD_SOURCE, "headers": ING}, 422),
        ("/v1/events", {"content": b"{}"}, 401),
    ],
    ("DELETE", "/v1/sources/{source_id}/producer"): [
        ("/v1/sources/nobody/producer", {"headers": {**ING, **KEY}}, 200),
        ("/v1/sources/stuck-engine/producer", {"headers": {**ING, ev.PRODUCER_HEADER: "other"}}, 409),
        ("/v1/sources/stuck-engine/producer", {"headers": ING}, 422),
    ],
    ("GET", "/v1/requests/{request_id}"): [
        ("/v1/requests/{rid}", {"headers": RD}, 200),
        ("/v1/requests/stuck", {"headers": RD}, 200),
        ("/v1/requests/nope", {"headers": RD}, 404),
    ],
    ("GET", "/v1/sources"): [("/v1/sources", {"headers": RD}, 200), ("/v1/sources", {}, 401)],
    ("GET", "/v1/policy"): [("/v1/policy", {"headers": ADM}, 200), ("/v1/policy", {"headers": RD}, 403)],
    ("PUT", "/v1/policy"): [
        ("/v1/policy", {"json": "{policy}", "headers": ADM}, 200),
        ("/v1/policy", {"json": {"rules": {"nope": 1}}, "headers": ADM}, 422),
    ],
    ("GET", "/v1/commands"): [
        ("/v1/commands", {"params": {"source_id": "stuck-engine"}, "headers": {**ING, **KEY}}, 200),
        ("/v1/commands", {"params": {"source_id": "stuck-engine"}, "headers": ING}, 403),
        ("/v1/commands", {"headers": ING}, 422),
    ],
    ("GET", "/v1/cutoffs"): [
        ("/v1/cutoffs", {"headers": RD}, 200),
        ("/v1/cutoffs", {"params": {"state": "bogus"}, "headers": RD}, 422),
    ],
    ("GET", "/v1/webhooks"): [("/v1/webhooks", {"headers": ADM}, 200)],
    ("POST", "/v1/webhooks"): [
        ("/v1/webhooks", {"json": "{webhook}", "headers": ADM}, 201),
        ("/v1/webhooks", {"json": {"url": "http://x"}, "headers": ADM}, 422),
    ],
    ("DELETE", "/v1/webhooks/{sub_id}"): [
        ("/v1/webhooks/{sub}", {"headers": ADM}, 200),
        ("/v1/webhooks/nope", {"headers": ADM}, 404),
    ],
    ("GET", "/v1/webhooks/deliveries"): [
        ("/v1/webhooks/deliveries", {"headers": ADM}, 200),
        ("/v1/webhooks/deliveries", {"params": {"limit": 5000}, "headers": ADM}, 422),
    ],
    ("GET", "/metrics"): [("/metrics", {"headers": RD}, 200), ("/metrics", {}, 401)],
    ("GET", "/v1/attribution"): [
        ("/v1/attribution", {"headers": RD}, 200),
        ("/v1/attribution", {"params": {"group_by": "model,finish_reason", "bucket_s": 5}, "headers": RD},
         200),
        ("/v1/attribution", {"params": {"since": "yesterday-ish"}, "headers": RD}, 422),
    ],
    ("GET", "/v1/requests"): [
        ("/v1/requests", {"params": {"limit": 50}, "headers": RD}, 200),
        ("/v1/requests", {"params": {"live": True}, "headers": RD}, 200),
        ("/v1/requests", {"params": {"sort": "nope"}, "headers": RD}, 422),
    ],
    ("GET", "/v1/itl"): [
        ("/v1/itl", {"headers": RD}, 200),
        ("/v1/itl", {"params": {"by_model": True}, "headers": RD}, 200),
        ("/v1/itl", {"params": {"by_model": "maybe"}, "headers": RD}, 422),
    ],
    ("GET", "/v1/requests/{request_id}/itl"): [
        ("/v1/requests/{rid}/itl", {"headers": RD}, 200),
        ("/v1/requests/nope/itl", {"headers": RD}, 404),
    ],
    ("GET", "/v1/requests/{request_id}/why"): [
        ("/v1/requests/{rid}/why", {"headers": RD}, 200),
        ("/v1/requests/{preempted}/why", {"params": {"top": 50}, "headers": RD}, 200),
        ("/v1/requests/stuck/why", {"headers": RD}, 200),
        ("/v1/requests/nope/why", {"headers": RD}, 404),
        ("/v1/requests/{rid}/why", {"params": {"top": 99}, "headers": RD}, 422),
    ],
    ("GET", "/v1/kv/stalls"): [
        ("/v1/kv/stalls", {"headers": RD}, 200),
        ("/v1/kv/stalls", {"params": {"horizon_s": -1}, "headers": RD}, 422),
    ],
    ("GET", "/v1/engines"): [
        ("/v1/engines", {"headers": RD}, 200),
        ("/v1/engines", {"params": {"top": 1, "rank_by": "waiting", "source_id": SIM}, "headers": RD}, 200),
        ("/v1/engines", {"params": {"rank_by": "hot"}, "headers": RD}, 422),
        ("/v1/engines", {"params": {"bucket_s": 1e-6}, "headers": RD}, 422),
    ],
    ("GET", "/v1/advice/chunk-size"): [
        ("/v1/advice/chunk-size", {"params": {"itl_target_ms": 80, "model": SIM}, "headers": RD}, 200),
        ("/v1/advice/chunk-size", {"params": {"itl_target_ms": 1, "model": SIM}, "headers": RD}, 409),
        ("/v1/advice/chunk-size", {"params": {"itl_target_ms": 80, "model": "nope"}, "headers": RD}, 404),
        ("/v1/advice/chunk-size", {"params": {"itl_target_ms": 80}, "headers": RD}, 422),  # two models
        ("/v1/advice/chunk-size", {"headers": RD}, 422),
    ],
    ("GET", "/v1/whatif"): [
        ("/v1/whatif", {"params": {**WHATIF, "force": True}, "headers": RD}, 200),
        ("/v1/whatif", {"params": {**WHATIF, "model": "nope"}, "headers": RD}, 404),
        ("/v1/whatif", {"params": {"model": SIM, "set": "bogus=1"}, "headers": RD}, 422),
    ],
    ("POST", "/v1/sql"): [
        ("/v1/sql", {"json": {"sql": "SELECT request_id, e2e_s FROM requests LIMIT 5"}, "headers": RD}, 200),
        ("/v1/sql", {"json": {"sql": "SELECT 1 AS one"}, "headers": {**RD, "Accept": "text/csv"}}, 200),
        ("/v1/sql", {"json": {"sql": "DELETE FROM requests"}, "headers": RD}, 400),
        ("/v1/sql", {"json": {"sql": ""}, "headers": RD}, 422),
    ],
    ("GET", "/v1/export/{table}.parquet"): [
        ("/v1/export/steps.parquet", {"headers": RD}, 200),
        ("/v1/export/users.parquet", {"headers": RD}, 404),
        ("/v1/export/steps.parquet", {"params": {"since": "soon"}, "headers": RD}, 400),
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A DuckDB ledger with the simulator's traffic: one engine short of KV (preemptions), long prompts,
    runaways (cutoffs)."""
    tmp = tmp_path_factory.mktemp("answers")
    url = f"duckdb:///{tmp / 'ledger.duckdb'}"
    server = LedgerServer(url, tmp / "ledger.log")
    server.start()
    scenario = dataclasses.replace(SCENARIOS["kv-pressure"], runaway_p=0.05, long_prompt_p=0.05)
    SCENARIOS["answers-contract"] = scenario
    try:
        summary = run_simulation(
            engines=1,
            rps=8,
            duration_s=30,
            ledger_url=server.url,
            scenario="answers-contract",
            model=SIM,
            seed=3,
            pace=False,
            spool_dir=str(tmp / "spool"),
        )
        assert summary["requests"] > 50 and not summary["exporter"]["dropped"]
    finally:
        server.stop()
        SCENARIOS.pop("answers-contract")
    return url


def _stuck_batch(seq: int) -> bytes:
    """A second model's engine: a request queued 20 s ago and never scheduled (a stall, a starvation
    alert)."""
    t = time.time() - 20
    return ev.encode_batch(STUCK, [ev.Queued(seq=seq, ts=t, request_id="stuck", prompt_tokens=10)])


@pytest.fixture(scope="module")
def client(recorded: str) -> Iterator[TestClient]:
    app = create_app(Settings(db_url=recorded, webhook_allow="127.0.0.1", **TOKENS))
    with TestClient(app, raise_server_exceptions=False) as c:
        c.put("/v1/policy", json={"alerts": {"starvation_wait_s": 5}}, headers=ADM).raise_for_status()
        hook = {"url": f"http://127.0.0.1:{free_port()}/h", "secret": "s" * 16, "event_types": ["starvation"]}
        c.post("/v1/webhooks", json=hook, headers=ADM).raise_for_status()
        posted = c.post("/v1/events", content=_stuck_batch(1), headers={**ING, **KEY})
        posted.raise_for_status()
        app.state.runaway.tick(time.time() + 5)
        yield c


@pytest.fixture(scope="module")
def doc(client: TestClient) -> dict[str, Any]:
    return client.get("/openapi.json").json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def names(client: TestClient) -> dict[str, str]:
    """What the paths name: a finished request, a preempted one, a subscription to delete."""
    rows = client.get("/v1/requests", params={"sort": "e2e_s", "limit": 1000}, headers=RD).json()["rows"]
    finished = [r for r in rows if r["end_ts"] is not None]
    preempted = next(r for r in finished if r["preemptions"])
    hook = {"url": "http://127.0.0.1:9/h", "secret": "s" * 16, "event_types": ["cutoff"]}
    sub = client.post("/v1/webhooks", json=hook, headers=ADM).json()["id"]
    return {"rid": finished[0]["request_id"], "preempted": preempted["request_id"], "sub": sub}


def _fill(value: Any, names: dict[str, str], seq: list[int]) -> Any:
    if value == "{batch}":
        seq[0] += 1
        return _stuck_batch(seq[0])
    if value == "{policy}":
        return {"alerts": {"starvation_wait_s": 5}}
    if value == "{webhook}":
        return {"url": "http://127.0.0.1:9/h", "secret": "s" * 16, "event_types": ["cutoff"]}
    if isinstance(value, dict):
        return {k: _fill(v, names, seq) for k, v in value.items()}
    return value


def _served(client: TestClient) -> set[tuple[str, str]]:
    return {
        (method, route.path)
        for route in client.app.routes
        if getattr(route, "include_in_schema", False)
        for method in getattr(route, "methods", ()) - {"HEAD"}
    }


def _schema(doc: dict[str, Any], method: str, path: str, status: int, media: str) -> dict[str, Any]:
    responses = doc["paths"][path][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {path}: {status} is not documented"
    content = {m.split(";")[0].strip(): spec for m, spec in responses[str(status)]["content"].items()}
    assert media in content, f"{method} {path} {status}: {media} is not documented ({sorted(content)})"
    return content[media]["schema"]  # type: ignore[no-any-return]


def _validator(doc: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def test_every_route_of_the_app_has_a_case():
    app = create_app(Settings(db_url="duckdb:///:memory:", **TOKENS))
    served = {
        (method, route.path)
        for route in app.routes
        if getattr(route, "include_in_schema", False)
        for method in getattr(route, "methods", ()) - {"HEAD"}
    }
    assert served == set(CASES)


CALLS = [(route, case) for route, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("route", "case"), CALLS, ids=[f"{r[0]} {c[0]} {c[2]}" for r, c in CALLS])
def test_each_answer_matches_the_schema_its_route_publishes(client, doc, names, route, case):
    method, template = route
    path, kwargs, status = case
    seq = [int(time.time() * 1e6)]
    r = client.request(method, path.format(**names), **_fill(kwargs, names, seq))
    assert r.status_code == status, r.text[:2000]
    media = r.headers["content-type"].split(";")[0].strip()
    schema = _schema(doc, method, template, status, media)
    if media != "application/json":
        assert r.content  # text, CSV and Parquet answers: their media type is what is documented
        return
    _validator(doc, schema).validate(r.json())


def _strict_violations(doc: dict[str, Any], schema: Any, where: str, seen: set[str]) -> list[str]:
    """Objects in ``schema`` (references followed) that take fields they do not name."""
    out: list[str] = []
    if isinstance(schema, list):
        for s in schema:
            out += _strict_violations(doc, s, where, seen)
        return out
    if not isinstance(schema, dict):
        return out
    ref = schema.get("$ref")
    if ref is not None:
        name = ref.rsplit("/", 1)[-1]
        if name not in seen:
            seen.add(name)
            out += _strict_violations(doc, doc["components"]["schemas"][name], name, seen)
        return out
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and schema.get("additionalProperties", True) is True and "patternProperties" not in schema:
        out.append(where)
    for key, value in schema.items():
        if key in ("properties", "$defs"):
            for name, sub in value.items():
                out += _strict_violations(doc, sub, f"{where}.{name}", seen)
        elif isinstance(value, dict | list):
            out += _strict_violations(doc, value, where, seen)
    return out


# The wire contract's answers (``engine_hooks.events``): sources decode them leniently on purpose, so a
# newer ledger may add a field without breaking older exporters.
LENIENT = {"IngestResponse", "CommandsResponse", "Command"}


def test_every_json_answer_schema_refuses_fields_it_does_not_name(doc):
    loose: dict[str, list[str]] = {}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            ok = op["responses"].get("200") or op["responses"].get("201")
            schema = ok["content"].get("application/json", {}).get("schema")
            if schema is not None:
                found = _strict_violations(doc, schema, f"{method.upper()} {path}", set())
                found = [f for f in found if f not in LENIENT]
                if found:
                    loose[f"{method.upper()} {path}"] = found
    assert loose == {}


def _add_unknown_field(answer: Any) -> bool:
    """Put a field no schema names into the first object of ``answer``; False: there is none."""
    if isinstance(answer, dict):
        answer["surely_not_a_field"] = 1
        return True
    if isinstance(answer, list):
        return any(_add_unknown_field(a) for a in answer)
    return False


@pytest.mark.parametrize(
    "path",
    [
        "/v1/requests/{rid}/why",
        "/v1/requests/{preempted}/why",
        f"/v1/advice/chunk-size?itl_target_ms=80&model={SIM}",
        "/v1/attribution?group_by=model",
        "/v1/kv/stalls",
        "/v1/engines?top=1",
        "/v1/requests?limit=5",
        "/v1/requests/{rid}/itl",
        "/v1/requests/{preempted}",
    ],
)
def test_a_wrong_answer_fails_its_schema(client, doc, names, path):
    """The check would catch an answer that drifted from its record: an unknown field, a missing one."""
    r = client.get(path.format(**names), headers=RD)
    template = re.sub(r"\{(rid|preempted)\}", "{request_id}", path.split("?")[0])
    validator = _validator(doc, _schema(doc, "GET", template, 200, "application/json"))
    answer = r.json()
    validator.validate(answer)
    extra = copy.deepcopy(answer)
    assert _add_unknown_field(extra)
    assert not validator.is_valid(extra)
    missing = copy.deepcopy(answer)
    missing.pop(next(iter(missing)))
    assert not validator.is_valid(missing)


def test_the_answers_checked_hold_rows_not_empty_lists(client, names):
    """The schemas above are checked on real rows: the data has cutoffs, a webhook delivery, live and
    preempted requests, and why items with culprits."""
    get = lambda path, **params: client.get(path, params=params, headers=RD).json()  # noqa: E731
    assert get("/v1/cutoffs")["cutoffs"]
    assert client.get("/v1/webhooks/deliveries", headers=ADM).json()["deliveries"]
    assert get("/v1/kv/stalls")["requests"]
    engines = get("/v1/engines", top=1)
    assert engines["engines"] and {p["kind"] for p in engines["points"]} >= {"model", "engine"}
    assert {s["kind"] for s in get("/v1/sources")["sources"]} == {"engine", "gateway"}
    why = get(f"/v1/requests/{names['preempted']}/why", top=50)
    assert {i["kind"] for i in why["items"]} >= {"preempted"}
    assert any(c for i in why["items"] for c in i["culprits"])
    assert get(f"/v1/requests/{names['rid']}")["events"]
