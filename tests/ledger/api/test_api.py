"""The HTTP API through the real app (both backends): ingest, errors, auth, reads, health."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator

import msgspec
import pytest
from fastapi.testclient import TestClient

from engine_hooks import events as ev
from ledger.app import create_app
from ledger.config import Settings
from ledger.migrate import head_revision
from tests.support.factories import ENGINE, GATEWAY, body, lifecycle, numbered

TOKENS = {"ingest_token": "ing", "read_token": "rd", "admin_token": "adm"}
ING = {"Authorization": "Bearer ing"}
RD = {"Authorization": "Bearer rd"}


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    app = create_app(Settings(db_url=db_url, max_body_bytes=64 * 1024, max_events_per_batch=1000, **TOKENS))
    with TestClient(app) as c:
        yield c


def _post(client: TestClient, data: bytes, headers=ING):
    return client.post("/v1/events", content=data, headers={**headers, "content-type": "application/json"})


def test_ingest_answers_accepted_duplicates_and_an_empty_command_list(client):
    gw, en = lifecycle("r1")
    r = _post(client, body(ENGINE, numbered(en)))
    assert r.status_code == 200
    assert r.json() == {"accepted": len(en), "duplicates": 0, "commands": []}
    assert _post(client, body(ENGINE, numbered(en))).json() == {
        "accepted": 0,
        "duplicates": len(en),
        "commands": [],
    }
    assert _post(client, body(GATEWAY, numbered(gw))).json()["accepted"] == len(gw)


def test_ingest_response_decodes_with_the_shared_contract(client):
    _, en = lifecycle("r1")
    r = _post(client, body(ENGINE, numbered(en)))
    assert ev.response_decoder.decode(r.content).accepted == len(en)


def test_wrong_field_type_is_a_422_naming_event_index_and_field_and_nothing_is_stored(client):
    evs = numbered([ev.Queued(seq=0, ts=5.0, request_id=f"r{i}", prompt_tokens=3) for i in range(4)])
    raw = msgspec.json.decode(body(ENGINE, evs))
    raw["events"][2]["prompt_tokens"] = "many"
    r = _post(client, msgspec.json.encode(raw))
    assert r.status_code == 422
    assert r.json()["errors"] == [
        {"index": 2, "field": "prompt_tokens", "reason": "Expected `int`, got `str`"}
    ]
    assert client.get("/v1/requests/r0", headers=RD).status_code == 404  # all-or-nothing


def test_nul_in_any_text_field_is_a_422_naming_each_field_and_nothing_is_stored(client):
    # PostgreSQL text cannot hold NUL (it answered 503 "retry" for a batch that can never succeed)
    evs = numbered(
        [
            ev.Queued(seq=0, ts=5.0, request_id="nul\x00id", prompt_tokens=3),
            ev.Finished(seq=0, ts=6.0, request_id="ok", reason="stop", stop_reason="x\x00"),
            ev.Step(seq=0, ts=6.0, step=1, duration_s=0.01, request_ids=["ok", "b\x00ad"]),
        ]
    )
    src = ev.Source(id="eng\x00ine", kind="engine", model="m")
    r = _post(client, msgspec.json.encode(ev.Batch(source=src, events=evs)))
    assert r.status_code == 422
    assert [(e["index"], e["field"]) for e in r.json()["errors"]] == [
        (None, "source.id"),
        (0, "request_id"),
        (1, "stop_reason"),
        (2, "request_ids[1]"),
    ]
    assert client.get("/v1/requests/ok", headers=RD).status_code == 404
    # an escaped backslash before "u0000" is text, not a NUL
    fine = numbered([ev.Queued(seq=0, ts=5.0, request_id="back\\u0000slash", prompt_tokens=3)])
    assert _post(client, body(ENGINE, fine)).json()["accepted"] == 1


def test_request_ids_that_cannot_be_read_back_or_are_not_nfc_are_a_422_naming_the_field(client):
    # '/' and dot segments were stored and then 404 on /v1/requests/{id}; an NFD id was a second row
    nfd = unicodedata.normalize("NFD", "caf\u00e9")
    evs = numbered(
        [
            ev.Queued(seq=0, ts=5.0, request_id="a/b", prompt_tokens=3),
            ev.Finished(seq=0, ts=6.0, request_id="..", reason="stop"),
            ev.Queued(seq=0, ts=5.0, request_id=nfd, prompt_tokens=3),
            ev.Step(
                seq=0, ts=6.0, step=1, duration_s=0.01, request_ids=["ok", "x/y"], stalled_request_ids=["."]
            ),
        ]
    )
    r = _post(client, body(ENGINE, evs))
    assert r.status_code == 422
    assert [(e["index"], e["field"]) for e in r.json()["errors"]] == [
        (0, "request_id"),
        (1, "request_id"),
        (2, "request_id"),
        (3, "request_ids[1]"),
        (3, "stalled_request_ids[0]"),
    ]
    assert "NFC" in r.json()["errors"][2]["reason"] and "'/'" in r.json()["errors"][0]["reason"]
    # NFC text, dots inside an id and escaped non-ASCII are fine
    nfc = unicodedata.normalize("NFC", nfd)
    fine = numbered([ev.Queued(seq=0, ts=5.0, request_id=i, prompt_tokens=3) for i in (nfc, "v1.2", "...")])
    assert _post(client, body(ENGINE, fine)).json()["accepted"] == 3
    escaped = body(ENGINE, numbered([ev.Queued(seq=10, ts=5.0, request_id=nfd, prompt_tokens=3)]))
    escaped = escaped.replace("\u0301".encode(), b"\\u0301")  # all ASCII: the accent as a JSON escape
    assert escaped.isascii()
    assert _post(client, escaped).status_code == 422
    assert client.get(f"/v1/requests/{nfc}", headers=RD).status_code == 200


@pytest.mark.parametrize(
    ("event", "field", "value", "reason_part"),
    [
        ({"kind": "queued", "request_id": "r", "prompt_tokens": 3}, "seq", 2**63, "<= 9223372036854775807"),
        ({"kind": "queued", "request_id": "r"}, "prompt_tokens", 2**63, "<= 2147483647"),
        ({"kind": "queued", "request_id": "r", "prompt_tokens": 3}, "priority", -(2**63) - 1, ">= -9223"),
        ({"kind": "step", "duration_s": 0.1}, "step", 2**64, "<= 9223372036854775807"),
        (
            {"kind": "chunk", "request_id": "r", "step": 1, "computed_before": 0},
            "tokens",
            2**62,
            "<= 2147483647",
        ),
        (
            {"kind": "tokens", "request_id": "r", "count": 1, "total": 1},
            "token_ids",
            [2**64],
            "<= 2147483647",
        ),
        ({"kind": "queued", "request_id": "r", "prompt_tokens": 3}, "ts", 1e308, "<= 10000000000.0"),
        ({"kind": "step", "step": 1}, "duration_s", 1e300, "<= 1000000000.0"),
    ],
)
def test_a_value_outside_the_contracts_range_is_a_422_naming_the_field_on_both_backends(
    client, event, field, value, reason_part
):
    # DuckDB answered OverflowError, PostgreSQL NumericValueOutOfRange: a 503 "retry" that the exporter
    # would retry and spool for ever, holding its source's backlog.
    raw = {"seq": 1, "ts": 5.0, **event, field: value}
    r = _post(client, msgspec.json.encode({"source": {"id": "e", "kind": "engine"}, "events": [raw]}))
    assert r.status_code == 422, r.text
    [err] = r.json()["errors"]
    assert err["index"] == 0 and err["field"].startswith(field) and reason_part in err["reason"], err
    _, en = lifecycle("after-range")
    assert _post(client, body(ENGINE, numbered(en))).json()["accepted"] == len(en)


def test_stalled_lists_of_different_lengths_are_a_422(client):
    step = ev.Step(
        seq=0, ts=5.0, step=1, duration_s=0.01, stalled_request_ids=["a", "b"], stalled_kv_blocks=[3]
    )
    r = _post(client, body(ENGINE, numbered([step])))
    assert r.status_code == 422
    [err] = r.json()["errors"]
    assert err["field"] == "stalled_kv_blocks" and "1 block counts for 2 stalled requests" in err["reason"]


@pytest.mark.parametrize(
    ("columns", "field", "reason_part"),
    [
        ({"token_counts": [1], "token_totals": [1]}, "token_counts", "1 counts for 2 requests"),
        ({"token_counts": [1, 1], "token_totals": [1]}, "token_totals", "1 totals for 2 counts"),
        ({"token_counts": [2, 1], "token_totals": [1, 9]}, "token_totals[0]", "less than this step's 2"),
        ({"token_counts": [1, 3], "token_totals": [4, 2]}, "token_totals[1]", "2 is less than this step's 3"),
        (
            {"token_counts": [2, 1], "token_totals": [2, 9], "token_ids": [4, 5]},
            "token_ids",
            "2 ids for 3 new tokens",
        ),
    ],
)
def test_a_steps_token_columns_that_do_not_line_up_are_a_422_and_nothing_is_stored(
    client, columns, field, reason_part
):
    _, en = lifecycle("kept")
    step = ev.Step(seq=0, ts=5.0, step=1, duration_s=0.01, request_ids=["a", "b"], **columns)
    r = _post(client, body(ENGINE, numbered([*en, step])))
    assert r.status_code == 422, r.text
    [err] = r.json()["errors"]
    assert err["index"] == len(en) and err["field"] == field and reason_part in err["reason"], err
    assert client.get("/v1/requests/kept", headers=RD).status_code == 404  # all or nothing


def test_tokens_carried_by_steps_make_the_request_rows_token_columns(client):
    _, en = lifecycle("s1")
    t0 = en[-1].ts + 1.0
    steps = [
        ev.Step(
            seq=0,
            ts=t0 + k,
            step=100 + k,
            duration_s=0.5,
            request_ids=["s1", "s2"],
            token_counts=[1, 2],
            token_totals=[70 + k, 2 * (k + 1)],
            token_ids=[k, k, k],
        )
        for k in range(3)
    ]
    assert _post(client, body(ENGINE, numbered([*en, *steps]))).json()["accepted"] == len(en) + 3
    s1 = client.get("/v1/requests/s1", headers=RD).json()["request"]
    s2 = client.get("/v1/requests/s2", headers=RD).json()["request"]
    assert s1["output_tokens"] == 72 and s1["last_token_ts"] == pytest.approx(t0 + 2.5)
    assert s2["output_tokens"] == 6 and s2["first_token_ts"] == pytest.approx(t0 + 0.5)
    assert s2["last_token_ts"] == pytest.approx(t0 + 2.5) and s2["step_count"] == 3


def test_sums_at_the_contracts_limits_saturate_and_every_read_stays_readable(client):
    # Three valid batches with tokens and cached_tokens near 2^62 made the DuckDB view fail for good
    # (INT128 cannot be cast to INT64): reads 500, export and compaction failing every second.
    big = ev.COUNT_MAX
    for n in range(3):
        chunk = ev.Chunk(
            seq=0, ts=5.0 + n, request_id="huge", step=n, tokens=big, computed_before=0, cached_tokens=big
        )
        assert _post(client, body(ENGINE, numbered([chunk], start=10 * n + 1))).status_code == 200
    row = client.get("/v1/requests/huge", headers=RD).json()["request"]
    assert (row["cached_tokens"], row["prefill_computed_tokens"], row["chunks"]) == (3 * big, 3 * big, 3)
    assert client.get("/v1/requests", headers=RD).status_code == 200


@pytest.mark.parametrize("depth", [1_000, 20_000])
def test_deeply_nested_json_is_a_422_naming_the_body_and_the_next_batch_is_stored(client, depth):
    _, en = lifecycle("after-nest")
    raw = body(ENGINE, numbered(en))
    nested = raw[:-1] + b', "junk": ' + b"[" * depth + b"]" * depth + b"}"
    r = _post(client, nested)
    assert r.status_code == 422
    assert r.json()["errors"] == [
        {"index": None, "field": "body", "reason": "JSON nested deeper than the decoder allows"}
    ]
    assert _post(client, raw).json()["accepted"] == len(en)


@pytest.mark.parametrize(
    ("mutate", "index", "field", "reason_part"),
    [
        (lambda e: e[1].pop("request_id"), 1, "request_id", "missing required field"),
        (lambda e: e[0].update(kind="teleported"), 0, "kind", "Invalid value 'teleported'"),
        (lambda e: e[1].update(ts=-3), 1, "ts", "Expected `float` >"),
        (lambda e: e[1].update(seq=e[0]["seq"]), 1, "seq", "must increase within a batch"),
        (lambda e: e[0].update(request_id=""), 0, "request_id", "length >= 1"),
        (
            lambda e: e.append({"kind": "arrived", "seq": 99, "ts": 5.0, "request_id": "x"}),
            3,
            "kind",
            "engine source cannot send 'arrived'",
        ),
    ],
)
def test_each_kind_of_bad_event_is_named_in_the_422(client, mutate, index, field, reason_part):
    evs = numbered([ev.Queued(seq=0, ts=5.0, request_id=f"r{i}", prompt_tokens=3) for i in range(3)])
    raw = msgspec.json.decode(body(ENGINE, evs))
    mutate(raw["events"])
    r = _post(client, msgspec.json.encode(raw))
    assert r.status_code == 422, r.text
    (err,) = r.json()["errors"]
    assert (err["index"], err["field"]) == (index, field)
    assert reason_part in err["reason"]


def test_batch_level_errors_name_the_field(client):
    r = _post(client, b'{"source": {"id": "e", "kind": "toaster"}, "events": []}')
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"] == "source.kind"
    r = _post(client, b"{not json")
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "body"
    evs = numbered([ev.Queued(seq=0, ts=5.0, request_id=f"r{i}", prompt_tokens=3) for i in range(1001)])
    r = _post(client, body(ENGINE, evs))
    assert r.status_code in (413, 422)


def test_body_over_the_limit_is_a_413(client):
    evs = numbered([ev.Queued(seq=0, ts=5.0, request_id="r" * 200, prompt_tokens=3) for _ in range(400)])
    data = body(ENGINE, evs)
    assert len(data) > 64 * 1024
    r = _post(client, data)
    assert r.status_code == 413
    assert "64" in r.json()["detail"] or "65536" in r.json()["detail"]


def test_tokens_missing_wrong_and_of_another_role(client):
    data = body(ENGINE, numbered(lifecycle("r1")[1]))
    assert _post(client, data, headers={}).status_code == 401
    assert _post(client, data, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert _post(client, data, headers=RD).status_code == 403
    assert _post(client, data, headers={"Authorization": "Bearer adm"}).status_code == 200
    assert client.get("/v1/requests/r1", headers=ING).status_code == 403
    assert client.get("/v1/requests/r1").status_code == 401
    assert client.get("/v1/requests/r1", headers=RD).status_code == 200


def test_request_endpoint_returns_the_row_and_the_timeline(client):
    gw, en = lifecycle("r1")
    _post(client, body(GATEWAY, numbered(gw)))
    _post(client, body(ENGINE, numbered(en)))
    r = client.get("/v1/requests/r1", headers=RD)
    assert r.status_code == 200
    doc = r.json()
    assert doc["request"]["request_id"] == "r1" and doc["request"]["preemptions"] == 1
    assert doc["events"][0]["kind"] == "arrived"
    assert len(doc["events"]) == len(gw) + len(en)
    assert client.get("/v1/requests/nope", headers=RD).status_code == 404


def test_sources_endpoint_reports_high_water_marks(client):
    _post(client, body(ENGINE, numbered(lifecycle("r1")[1], start=10)))
    (src,) = client.get("/v1/sources", headers=RD).json()["sources"]
    assert src["source_id"] == "engine-0" and src["last_seq"] == 10 + len(lifecycle("r1")[1]) - 1


def test_health_and_readiness(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["schema"] == head_revision()


def test_storage_failure_is_a_retryable_503_and_keeps_what_was_accepted(client, monkeypatch):
    ok = numbered([ev.Queued(seq=0, ts=5.0, request_id="kept", prompt_tokens=3)])
    assert _post(client, body(ENGINE, ok)).status_code == 200
    store = client.app.state.store

    def broken(batches, *rest):
        raise OSError("database unreachable")

    monkeypatch.setattr(store, "write", broken)
    later = numbered([ev.Queued(seq=0, ts=6.0, request_id="later", prompt_tokens=3)], start=2)
    r = _post(client, body(ENGINE, later))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "database unreachable" in r.json()["detail"]  # the store's own failure, not a call error
    monkeypatch.undo()
    assert client.get("/v1/requests/kept", headers=RD).status_code == 200
    assert _post(client, body(ENGINE, later)).json()["accepted"] == 1


def test_unknown_fields_from_a_newer_source_are_ignored(client):
    raw = msgspec.json.decode(
        body(ENGINE, numbered([ev.Queued(seq=0, ts=5.0, request_id="a", prompt_tokens=3)]))
    )
    raw["events"][0]["brand_new_field"] = {"x": 1}
    assert _post(client, msgspec.json.encode(raw)).status_code == 200


def test_newer_schema_version_is_refused(client):
    raw = msgspec.json.decode(body(ENGINE, []))
    raw["schema_version"] = ev.SCHEMA_VERSION + 1
    r = _post(client, msgspec.json.encode(raw))
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "schema_version"


def test_open_ledger_on_loopback_needs_no_token(db_url):
    with TestClient(create_app(Settings(db_url=db_url)), base_url="http://127.0.0.1:8787") as c:
        data = body(ENGINE, numbered([ev.Queued(seq=0, ts=5.0, request_id="a", prompt_tokens=3)]))
        assert c.post("/v1/events", content=data).status_code == 200
        assert c.get("/v1/requests/a").status_code == 200


def test_a_timestamp_far_ahead_is_stored_as_the_receive_time_and_counted(client):
    import time

    now = time.time()
    evs = numbered(
        [
            ev.Queued(seq=0, ts=now + 3600, request_id="ahead", prompt_tokens=3, arrival_ts=now + 3600),
            ev.Tokens(seq=0, ts=now + 60, request_id="ahead", count=1, total=1, first_ts=now + 1e6),
            ev.Step(seq=0, ts=1e10, step=1, duration_s=0.01, request_ids=["ahead"]),
            ev.Queued(seq=0, ts=now + 10, request_id="near", prompt_tokens=3),  # within 300 s: kept
        ]
    )
    assert _post(client, body(ENGINE, evs)).json()["accepted"] == 4
    after = time.time()
    stored = client.get("/v1/requests/ahead", headers=RD).json()
    ts = {e["kind"]: e["ts"] for e in stored["events"]}
    assert now <= ts["queued"] <= after and ts["tokens"] == now + 60  # 60 s ahead is within the limit
    row = stored["request"]
    assert now <= row["engine_arrival_ts"] <= after and now <= row["first_token_ts"] <= after
    assert now <= row["last_step_ts"] <= after + 0.01
    near = client.get("/v1/requests/near", headers=RD).json()["request"]
    assert near["queued_ts"] == now + 10
    metrics = client.get("/metrics", headers=RD).text
    assert 'chunkledger_ingest_future_timestamps_total{source="engine-0"} 3.0' in metrics


def test_one_event_stamped_an_hour_ahead_does_not_make_the_rules_abort_other_requests(client):
    import time

    adm = {"Authorization": "Bearer adm"}
    policy = {"rules": {"wall_clock_timeout_s": 60, "stall_timeout_s": 0}}
    assert client.put("/v1/policy", json=policy, headers=adm).status_code == 200
    now = time.time()
    _post(client, body(ENGINE, numbered([ev.Queued(seq=0, ts=now + 3600, request_id="x", prompt_tokens=3)])))
    rules = client.app.state.runaway.rules
    # the rule engine alone, without the ingest clamp: a source's clock cannot age other requests
    rules.observe(ENGINE, [ev.Queued(seq=5, ts=1e10, request_id="y", prompt_tokens=3)], now)
    normal = [ev.Queued(seq=0, ts=now, request_id=f"n{i}", prompt_tokens=3) for i in range(40)]
    assert _post(client, body(ENGINE, numbered(normal, start=10))).json()["accepted"] == 40
    assert rules.tick(now + 30) == []  # every request was received under 60 s ago
    assert {d.request_id for d in rules.tick(now + 61)} == {"x", "y"} | {f"n{i}" for i in range(40)}


def test_openapi_is_public_and_documents_the_event_and_policy_bodies_and_string_errors(client):
    r = client.get("/openapi.json")  # no token: it describes the API and holds no data
    assert r.status_code == 200
    doc = r.json()
    events = doc["paths"]["/v1/events"]["post"]
    body_schema = events["requestBody"]["content"]["application/json"]["schema"]
    assert body_schema["$ref"].endswith("/Batch")
    batch_schema = doc["components"]["schemas"]["Batch"]
    assert {"source", "events"} <= set(batch_schema["properties"])
    policy = doc["paths"]["/v1/policy"]["put"]["requestBody"]["content"]["application/json"]["schema"]
    assert policy["$ref"].split("/")[-1] in doc["components"]["schemas"]
    rejected = doc["components"]["schemas"]["BatchRejected"]
    assert rejected["properties"]["detail"]["type"] == "string"  # as sent: "<field>: <reason>"
    bad = _post(client, b'{"source": {"id": "s", "kind": "engine"}, "events": [{"kind": "nope"}]}')
    assert bad.status_code == 422 and isinstance(bad.json()["detail"], str)
    for page in ("/docs", "/redoc"):
        assert client.get(page).status_code == 200
