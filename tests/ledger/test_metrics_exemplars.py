"""Exemplars on the latency histograms: a request id and a trace id per bucket, in OpenMetrics (the
text format carries none), read back with prometheus-client's OpenMetrics parser."""

from __future__ import annotations

import time

import msgspec
from fastapi.testclient import TestClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from ledger.app import create_app
from ledger.config import Settings
from ledger.metrics import LedgerMetrics
from ledger.traces.spans import derived_id
from tests.support.factories import ENGINE, GATEWAY, body, lifecycle, numbered

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def _exemplars(text: str) -> dict[tuple[str, str, str], dict[str, str]]:
    """(sample name, its layer, its le) -> the exemplar's labels, over every bucket that has one."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.exemplar is not None:
                out[(s.name, s.labels.get("layer", ""), s.labels["le"])] = dict(s.exemplar.labels)
    return out


def test_ttft_e2e_and_layer_buckets_carry_the_request_and_its_trace(db_url):
    t0 = time.time() - 10
    gw, en = lifecycle("ex-1", t0)
    gw[0] = msgspec.structs.replace(
        gw[0], trace_id=TRACE, parent_span_id="00f067aa0ba902b7", span_id="b7ad6b7169203331"
    )
    app = create_app(Settings(db_url=db_url))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        for source, events in ((GATEWAY, gw), (ENGINE, en)):
            assert (
                c.post(
                    "/v1/events",
                    content=body(source, numbered(events)),
                    headers={"content-type": "application/json"},
                ).status_code
                == 200
            )
        app.state.runaway.tick(time.time() + 5)  # past the observation delay
        plain = c.get("/metrics")
        om = c.get("/metrics", headers={"Accept": OPENMETRICS})
    assert plain.headers["content-type"].startswith("text/plain") and "trace_id" not in plain.text
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")
    found = _exemplars(om.text)
    names = {name for name, _, _ in found}
    assert {
        "chunkledger_ttft_seconds_bucket",
        "chunkledger_client_ttft_seconds_bucket",
        "chunkledger_e2e_seconds_bucket",
        "chunkledger_request_layer_seconds_bucket",
    } <= names
    assert all(labels == {"request_id": "ex-1", "trace_id": TRACE} for labels in found.values())
    layers = {layer for name, layer, _ in found if name == "chunkledger_request_layer_seconds_bucket"}
    assert {"entry", "admission", "prefill", "decode"} <= layers


def test_an_untraced_request_names_the_trace_the_export_gives_it_and_a_long_id_is_left_out():
    m = LedgerMetrics()
    m.observe_request({"request_id": "plain", "model": "m", "ttft_s": 0.2, "e2e_s": 1.0})
    long_id = "x" * 256
    m.observe_request({"request_id": long_id, "model": "m", "ttft_s": 0.3, "e2e_s": 1.0, "trace_id": TRACE})
    found = _exemplars(m.render(openmetrics=True).decode())
    ttft = [labels for (name, _, _), labels in found.items() if name == "chunkledger_ttft_seconds_bucket"]
    assert {"request_id": "plain", "trace_id": derived_id("plain", "trace", 16)} in ttft
    # OpenMetrics: an exemplar's label names and values are at most 128 characters together; a request
    # id too long for that is left out (a cut one would open no request), the trace still links
    assert {"trace_id": TRACE} in ttft


def test_the_grafana_dashboard_asks_for_exemplars_on_every_latency_panel_that_has_them():
    import json
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[2] / "deploy/grafana/chunkledger.json").read_text())
    histograms = ("chunkledger_ttft_seconds", "chunkledger_e2e_seconds", "chunkledger_request_layer_seconds")
    targets = [
        t for p in dash["panels"] for t in p["targets"] if any(h + "_bucket" in t["expr"] for h in histograms)
    ]
    assert len(targets) >= 3
    assert all(t.get("exemplar") is True for t in targets)
