"""Prometheus metrics: names, types and labels on a fresh registry; the shipped alerts and dashboard only
use metrics that exist; /metrics auth; counters and histograms move with real traffic."""

from __future__ import annotations

import json
import re
import time

import msgspec
import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine_hooks import events as ev
from ledger.app import create_app
from ledger.config import Settings
from ledger.metrics import LedgerMetrics, set_advised_chunk
from tests.support import ROOT

ALLOWED_LABELS = {
    "model",
    "source",
    "rule",
    "action",
    "layer",
    "reason",
    "channel",
    "target",
    "event_type",
    "le",
    "label",  # chunkledger_metric_label_overflow_total: which bounded label folded a value
}

EXPECTED = {
    "chunkledger_request_layer_seconds": ("histogram", {"model", "layer"}),
    "chunkledger_ttft_seconds": ("histogram", {"model"}),
    "chunkledger_client_ttft_seconds": ("histogram", {"model"}),
    "chunkledger_itl_seconds": ("histogram", {"model"}),
    "chunkledger_e2e_seconds": ("histogram", {"model"}),
    "chunkledger_requests_finished": ("counter", {"model"}),
    "chunkledger_cutoffs": ("counter", {"rule", "action"}),
    "chunkledger_commands_delivered": ("counter", {"channel"}),
    "chunkledger_commands_applied": ("counter", {"rule", "target"}),
    "chunkledger_command_apply_seconds": ("histogram", {"target"}),
    "chunkledger_commands_expired": ("counter", set()),
    "chunkledger_webhook_attempts": ("counter", {"event_type"}),
    "chunkledger_webhook_failures": ("counter", {"event_type", "reason"}),
    "chunkledger_webhook_dead_letters": ("counter", {"event_type"}),
    "chunkledger_alerts": ("counter", {"event_type"}),
    "chunkledger_ingest_events": ("counter", {"source"}),
    "chunkledger_ingest_duplicates": ("counter", {"source"}),
    "chunkledger_ingest_batches": ("counter", {"source"}),
    "chunkledger_ingest_rejections": ("counter", {"reason"}),
    "chunkledger_request_refusals": ("counter", {"reason"}),
    "chunkledger_auth_failures": ("counter", {"reason"}),
    "chunkledger_ingest_future_timestamps": ("counter", {"source"}),
    "chunkledger_source_dropped_events": ("counter", {"source", "reason"}),
    "chunkledger_metric_label_overflow": ("counter", {"label", "reason"}),
    "chunkledger_advised_chunk_tokens": ("gauge", {"model"}),
    "chunkledger_live_requests": ("gauge", {"model"}),
    "chunkledger_kv_stalled_requests": ("gauge", {"model"}),
    "chunkledger_kv_stall_max_seconds": ("gauge", {"model"}),
    "chunkledger_webhook_outbox_pending": ("gauge", set()),
    "chunkledger_rule_intake_seconds": ("histogram", set()),
}


def _exercise(m: LedgerMetrics) -> None:
    """Touch one child of every labelled metric so that the exposition shows its labels."""
    m.observe_request(
        {"model": "x", "entry_s": 0.1, "admission_s": 0.1, "backend_wait_s": 0.1, "prefill_s": 0.1,
         "decode_s": 1.0, "e2e_s": 1.4, "ttft_s": 0.4, "client_ttft_s": 0.41, "output_tokens": 11}
    )  # fmt: skip
    m.commands_applied.labels("loop", "engine").inc()
    m.command_apply_seconds.labels("engine").observe(0.1)
    m.webhook_attempts.labels("cutoff").inc()
    m.webhook_failures.labels("cutoff", "status").inc()
    m.webhook_dead.labels("cutoff").inc()
    m.alerts.labels("starvation").inc()
    m.ingest_events.labels("e0").inc()
    m.ingest_duplicates.labels("e0").inc()
    m.ingest_batches.labels("e0").inc()
    m.ingest_future_timestamps.labels("e0").inc()
    m.source_dropped.labels("e0", "spool_full").inc()
    m.advised_chunk_tokens.labels("x").set(512)
    m.live.live = lambda: {"x": 1}
    m.live.stalled = lambda: {"x": 1}
    m.live.stall_max = lambda: {"x": 2.0}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_fresh_registry_has_every_metric_with_its_type_and_bounded_labels():
    m = LedgerMetrics()
    _exercise(m)
    fams = families(m.render().decode())
    assert set(EXPECTED) <= set(fams), set(EXPECTED) - set(fams)
    for name, (typ, labels) in EXPECTED.items():
        f = fams[name]
        assert f.type == typ, name
        seen = {k for s in f.samples for k in s.labels} - {"le"}
        assert seen == labels, (name, seen)
    for f in fams.values():
        assert f.name.startswith("chunkledger_")
        for s in f.samples:
            assert set(s.labels) <= ALLOWED_LABELS, (f.name, s.labels)  # never a request id
        if f.type == "counter":
            assert any(s.name.endswith("_total") for s in f.samples)


def test_two_apps_have_independent_registries_and_the_advice_gauge_reaches_both():
    a, b = LedgerMetrics(), LedgerMetrics()
    a.cutoffs.labels("loop", "abort").inc()
    assert b.registry.get_sample_value("chunkledger_cutoffs_total", {"rule": "loop", "action": "abort"}) == 0
    set_advised_chunk("llama", 768)
    for m in (a, b):
        assert m.registry.get_sample_value("chunkledger_advised_chunk_tokens", {"model": "llama"}) == 768


def test_cutoff_series_start_at_zero_for_every_rule():
    fams = families(LedgerMetrics().render().decode())
    rules = {(s.labels["rule"], s.labels["action"]) for s in fams["chunkledger_cutoffs"].samples}
    assert ("loop", "abort") in rules and ("preemption_limit", "slow_pool") in rules
    assert ("slow_pool_starved", "promote") in rules and ("loop", "promote") not in rules


def _referenced(text: str) -> set[str]:
    names = set(re.findall(r"\bchunkledger_[a-z0-9_]+", text))
    out = set()
    for n in names:
        for suffix in ("_bucket", "_sum", "_count"):
            if n.endswith(suffix) and n[: -len(suffix)] in EXPECTED:
                n = n[: -len(suffix)]
        out.add(n[: -len("_total")] if n.endswith("_total") else n)
    return out


def test_alert_rules_and_dashboard_use_only_metrics_that_exist():
    m = LedgerMetrics()
    _exercise(m)
    exposed = set(families(m.render().decode()))
    alerts = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    exprs = [r["expr"] for g in alerts["groups"] for r in g["rules"]]
    assert len(exprs) >= 10 and all(r.get("alert") for g in alerts["groups"] for r in g["rules"])
    dash = json.loads((ROOT / "deploy/grafana/chunkledger.json").read_text())
    targets = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    targets += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    for source, texts in (("alerts.yml", exprs), ("chunkledger.json", targets)):
        used = _referenced("\n".join(texts))
        assert used, source
        assert used <= exposed, (source, used - exposed)
    # histograms are used through their buckets, counters through _total
    assert "_bucket" in "".join(exprs) and "_total" in "".join(targets)


def test_metrics_endpoint_takes_the_read_token_or_a_separate_metrics_token(tmp_path):
    url = f"duckdb:///{tmp_path}/m.duckdb"
    with TestClient(create_app(Settings(db_url=url, read_token="rd", admin_token="adm"))) as c:
        assert c.get("/metrics").status_code == 401
        r = c.get("/metrics", headers={"Authorization": "Bearer rd"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert "chunkledger_cutoffs_total" in r.text
    with TestClient(create_app(Settings(db_url=url, read_token="rd", metrics_token="prom"))) as c:
        assert c.get("/metrics", headers={"Authorization": "Bearer rd"}).status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer prom"}).status_code == 200


def test_traffic_moves_ingest_counters_and_finished_requests_fill_the_histograms(db_url):
    src = ev.Source(id="e0", kind="engine", model="m")
    t = time.time() - 10
    evs = [
        ev.Queued(seq=1, ts=t, request_id="r1", prompt_tokens=100),
        ev.Chunk(seq=2, ts=t + 0.5, request_id="r1", step=1, tokens=100, computed_before=0, wait_s=0.5),
        ev.Tokens(seq=3, ts=t + 1.0, request_id="r1", count=1, total=1),
        ev.Tokens(seq=4, ts=t + 2.0, request_id="r1", count=10, total=11, first_ts=t + 1.1),
        ev.Finished(seq=5, ts=t + 2.0, request_id="r1", reason="stop", output_tokens=11),
    ]
    app = create_app(Settings(db_url=db_url))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        body = ev.encode_batch(src, evs)
        assert c.post("/v1/events", content=body).json()["accepted"] == 5
        assert c.post("/v1/events", content=body).json()["duplicates"] == 5
        assert c.post("/v1/events", content=b"{").status_code == 422
        app.state.runaway.tick(time.time() + 5)  # past the observation delay
        fams = families(c.get("/metrics").text)

    def value(name, **labels):
        for f in fams.values():
            for s in f.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return None

    assert value("chunkledger_ingest_events_total", source="e0") == 5
    assert value("chunkledger_ingest_duplicates_total", source="e0") == 5
    assert value("chunkledger_ingest_batches_total", source="e0") == 2
    assert value("chunkledger_ingest_rejections_total", reason="invalid") == 1
    # both stored batches reached the rule engine, each within the 5 s bucket; the rejected one did not
    assert value("chunkledger_rule_intake_seconds_count") == 2
    assert value("chunkledger_rule_intake_seconds_bucket", le="5.0") == 2
    assert value("chunkledger_requests_finished_total", model="m") == 1
    assert value("chunkledger_ttft_seconds_count", model="m") == 1
    assert abs(value("chunkledger_ttft_seconds_sum", model="m") - 1.0) < 1e-6
    assert abs(value("chunkledger_e2e_seconds_sum", model="m") - 2.0) < 1e-6
    assert value("chunkledger_itl_seconds_count", model="m") == 1
    assert value("chunkledger_request_layer_seconds_count", model="m", layer="decode") == 1
    assert value("chunkledger_live_requests", model="m") is None  # finished: not live


def test_rejections_are_counted_by_reason(tmp_path):
    app = create_app(Settings(db_url=f"duckdb:///{tmp_path}/r.duckdb", max_body_bytes=2048))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        assert c.post("/v1/events", content=b"x" * 5000).status_code == 413
        big = msgspec.json.encode({"source": {"id": "e", "kind": "engine"}, "events": [{"kind": "nope"}]})
        assert c.post("/v1/events", content=big).status_code == 422
        text = c.get("/metrics").text
    assert 'chunkledger_ingest_rejections_total{reason="too_large"} 1.0' in text
    assert 'chunkledger_ingest_rejections_total{reason="invalid"} 1.0' in text


def test_client_ttft_is_observed_beside_the_engines_and_only_when_a_gateway_measured_it():
    m = LedgerMetrics()
    m.observe_request({"model": "x", "ttft_s": 0.4, "client_ttft_s": 0.45, "e2e_s": 1.0, "output_tokens": 2})
    m.observe_request({"model": "x", "ttft_s": 0.3, "client_ttft_s": None, "e2e_s": 1.0, "output_tokens": 2})
    fams = families(m.render().decode())
    count = {
        f.name: next(s.value for s in f.samples if s.name.endswith("_count"))
        for f in fams.values()
        if f.name in ("chunkledger_ttft_seconds", "chunkledger_client_ttft_seconds")
    }
    assert count == {"chunkledger_ttft_seconds": 2, "chunkledger_client_ttft_seconds": 1}
    client_sum = next(
        s.value for s in fams["chunkledger_client_ttft_seconds"].samples if s.name.endswith("_sum")
    )
    assert client_sum == pytest.approx(0.45)
