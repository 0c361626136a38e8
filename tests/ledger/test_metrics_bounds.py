"""Issue 35, item 7: sources cannot blow up ``/metrics`` (attack replays on a real server, both backends).

Label values sources choose (model, source id, a dropped marker's reason) are capped in length and in
count; the rest are exported as ``other`` and counted in ``chunkledger_metric_label_overflow_total``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine_hooks import events as ev
from tests.support.factories import body, numbered
from tests.support.servers import LedgerServer, served_ledger

T0 = time.time() - 60
MAX_SOURCES = 10
MAX_MODELS = 4
MAX_REASONS = 3


@pytest.fixture(scope="module", params=["duckdb", "postgres"])
def ledger(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LedgerServer]:
    pg = request.getfixturevalue("pg_database") if request.param == "postgres" else None
    env = {
        "CHUNKLEDGER_METRICS_MAX_SOURCES": str(MAX_SOURCES),
        "CHUNKLEDGER_METRICS_MAX_MODELS": str(MAX_MODELS),
        "CHUNKLEDGER_METRICS_MAX_REASONS": str(MAX_REASONS),
    }
    with served_ledger(request.param, pg, Path(tmp_path_factory.mktemp("metrics")), env) as server:
        yield server


def _post(server: LedgerServer, source: ev.Source, events: list) -> None:
    r = httpx.post(f"{server.url}/v1/events", content=body(source, numbered(events)), timeout=30)
    assert r.status_code == 200, r.text


def _scrape(server: LedgerServer) -> str:
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200
    return r.text


def _values(text: str, family: str, label: str) -> set[str]:
    return set(re.findall(rf'^{family}\{{[^}}\n]*{label}="([^"]*)"', text, re.M))


def _overflow(text: str, label: str, reason: str) -> float:
    m = re.search(
        rf'^chunkledger_metric_label_overflow_total\{{label="{label}",reason="{reason}"\}} (\S+)$', text, re.M
    )
    return float(m.group(1)) if m else 0.0


def test_a_million_character_model_is_exported_as_other_and_the_scrape_stays_small(ledger):
    source = ev.Source(id="huge-model", kind="engine", model="m" * 1_000_000)
    _post(ledger, source, [ev.Queued(seq=0, ts=T0, request_id="huge-1", prompt_tokens=5)])
    text = _scrape(ledger)
    assert len(text.encode()) < 100_000  # was over 3 MB: the name in each live gauge
    assert (
        "mmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmmm"
        not in text
    )
    assert "other" in _values(text, "chunkledger_live_requests", "model")
    assert _overflow(text, "model", "too_long") >= 1


def test_models_beyond_the_cap_fold_into_other_in_the_latency_histograms(ledger):
    for i in range(3 * MAX_MODELS):
        source = ev.Source(id=f"model-src-{i}", kind="engine", model=f"attack-model-{i}")
        rid = f"model-req-{i}"
        _post(
            ledger,
            source,
            [
                ev.Queued(seq=0, ts=T0, request_id=rid, prompt_tokens=5),
                ev.Finished(seq=0, ts=T0 + 1, request_id=rid, reason="stop", output_tokens=1),
            ],
        )
    deadline = time.monotonic() + 20
    while True:  # finished requests are observed a few seconds after their finish
        text = _scrape(ledger)
        counts = re.findall(r'^chunkledger_requests_finished_total\{model="([^"]*)"\} (\S+)$', text, re.M)
        seen = sum(float(n) for m, n in counts if m.startswith("attack-model-") or m == "other")
        if seen >= 3 * MAX_MODELS or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert seen == 3 * MAX_MODELS
    models = _values(text, "chunkledger_e2e_seconds_bucket", "model")
    assert len(models) <= MAX_MODELS + 1 and "other" in models
    assert _overflow(text, "model", "too_many") >= 2 * MAX_MODELS - 1


def test_sources_and_dropped_reasons_beyond_their_caps_fold_into_other(ledger):
    for i in range(2 * MAX_SOURCES):
        source = ev.Source(id=f"many-src-{i}", kind="engine")
        _post(ledger, source, [ev.Dropped(seq=0, ts=T0, count=1, reason=f"reason-{i}")])
    text = _scrape(ledger)
    sources = _values(text, "chunkledger_ingest_batches_total", "source")
    assert len(sources) <= MAX_SOURCES + 1 and "other" in sources
    reasons = _values(text, "chunkledger_source_dropped_events_total", "reason")
    assert len(reasons) <= MAX_REASONS + 1 and "other" in reasons
    assert _overflow(text, "source", "too_many") >= MAX_SOURCES
    assert _overflow(text, "reason", "too_many") >= 2 * MAX_SOURCES - MAX_REASONS


def test_a_label_value_with_control_characters_is_exported_as_other(ledger):
    source = ev.Source(id="ctl-src", kind="engine", model="bad\nmodel")
    _post(ledger, source, [ev.Queued(seq=0, ts=T0, request_id="ctl-1", prompt_tokens=5)])
    text = _scrape(ledger)
    assert 'model="bad\\nmodel"' not in text
    assert _overflow(text, "model", "invalid") >= 1


def test_at_the_default_caps_the_largest_scrape_sources_can_cause_is_under_a_megabyte():
    # every bounded label at its cap, every value of the longest length, in every family that has it
    from ledger.config import Settings
    from ledger.metrics import LAYERS, LedgerMetrics

    d = Settings()
    m = LedgerMetrics(
        max_models=d.metrics_max_models,
        max_sources=d.metrics_max_sources,
        max_reasons=d.metrics_max_reasons,
        max_label_length=d.metrics_max_label_length,
    )
    longest = d.metrics_max_label_length

    def value(i: int, fill: str) -> str:
        return f"{i:04d}" + fill * (longest - 4)

    for i in range(300):
        row = {"model": value(i, "m"), **{f"{layer}_s": 0.5 for layer in LAYERS}, "ttft_s": 0.1}
        m.observe_request({**row, "client_ttft_s": 0.1, "e2e_s": 1.0, "output_tokens": 10})
    for i in range(300):
        sid = m.sources(value(i, "s"))
        for counter in (m.ingest_batches, m.ingest_events, m.ingest_duplicates, m.ingest_future_timestamps):
            counter.labels(sid).inc()
        for j in range(30):
            m.source_dropped.labels(sid, m.reasons(value(j, "r"))).inc()
    m.live.live = m.live.stalled = lambda: {value(i, "m"): 1 for i in range(300)}
    m.live.stall_max = lambda: {value(i, "m"): 1.0 for i in range(300)}
    assert len(m.render()) < 1_000_000
