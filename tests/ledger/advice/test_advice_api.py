"""GET /v1/advice/chunk-size through the real app (both backends) and ``chunkledger advise``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from chunkledger.main import app as cli_app
from engine_hooks import events as ev
from ledger.app import create_app
from ledger.config import Settings
from ledger.store import open_store
from tests.ledger.advice.test_advice import (
    MEASURED_SOURCE,
    WORKED_SOURCE,
    measured_steps,
    worked_steps,
    write_steps,
)

TOKENS = {"ingest_token": "ing", "read_token": "rd", "admin_token": "adm"}
RD = {"Authorization": "Bearer rd"}
URL = "/v1/advice/chunk-size"
runner = CliRunner()


@pytest.fixture
def client(db_url: str) -> Iterator[TestClient]:
    store = open_store(db_url)
    app = create_app(Settings(db_url=db_url, **TOKENS), store=store)
    with TestClient(app) as c:
        c.store = store  # type: ignore[attr-defined]
        yield c
    store.close()


def test_advice_endpoint_answers_settings_fit_and_window(client):
    write_steps(client.store, WORKED_SOURCE, worked_steps())
    r = client.get(URL, params={"itl_target_ms": 50}, headers=RD)
    assert r.status_code == 200, r.text
    a = r.json()
    assert set(a["settings"]) == {"max_num_batched_tokens", "long_prefill_token_threshold"}
    assert a["prefill_budget_ms"] == pytest.approx(40.0, abs=0.3)
    assert a["fit"]["r2"] > 0.99 and a["fit"]["steps_used"] == 3000
    assert a["fit"]["covers"]["prefill_depth"] == [0, 8192]
    assert a["window"]["model"] == "worked-example"
    assert [r["depth"] for r in a["by_depth"]] == [0, 4096, 8192]


def test_advice_endpoint_needs_the_read_token(client):
    assert client.get(URL, params={"itl_target_ms": 50}).status_code == 401
    r = client.get(URL, params={"itl_target_ms": 50}, headers={"Authorization": "Bearer ing"})
    assert r.status_code == 403


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({}, "itl_target_ms"),
        ({"itl_target_ms": 0}, "itl_target_ms"),
        ({"itl_target_ms": "fast"}, "itl_target_ms"),
        ({"itl_target_ms": 50, "depth": -1}, "depth"),
        ({"itl_target_ms": 50, "arrival_share": 1}, "arrival_share"),
        ({"itl_target_ms": 50, "max_steps": 5}, "max_steps"),
    ],
)
def test_bad_parameters_are_a_422_naming_the_field(client, params, field):
    r = client.get(URL, params=params, headers=RD)
    assert r.status_code == 422
    assert [e["loc"][-1] for e in r.json()["errors"]] == [field]


def test_refusals_are_409_or_422_with_a_reason_never_a_500(client):
    r = client.get(URL, params={"itl_target_ms": 50}, headers=RD)
    assert r.status_code == 409
    assert r.json()["reason"] == "too_little_data"
    write_steps(client.store, WORKED_SOURCE, worked_steps(60))
    r = client.get(URL, params={"itl_target_ms": 50}, headers=RD)
    assert (r.status_code, r.json()["reason"]) == (409, "too_little_data")
    assert "60 usable steps" in r.json()["detail"]
    write_steps(client.store, WORKED_SOURCE, worked_steps(3000, seed=1, first_seq=100))
    r = client.get(URL, params={"itl_target_ms": 50, "depth": 50_000}, headers=RD)
    assert (r.status_code, r.json()["reason"]) == (422, "depth_outside_data")
    r = client.get(URL, params={"itl_target_ms": 5}, headers=RD)
    assert (r.status_code, r.json()["reason"]) == (409, "target_unreachable")
    assert r.json()["advice"]["decode_ms"]["at_p99_batch"] == pytest.approx(10.0, abs=0.3)
    r = client.get(URL, params={"itl_target_ms": 50, "since": "yesterday"}, headers=RD)
    assert (r.status_code, r.json()["reason"]) == (422, "bad_time")
    r = client.get(URL, params={"itl_target_ms": 50, "source_id": "nope"}, headers=RD)
    assert (r.status_code, r.json()["reason"]) == (404, "unknown_source")


def test_advice_publishes_the_advised_chunk_to_the_metrics_gauge(client, monkeypatch):
    metrics = pytest.importorskip("ledger.metrics")
    published = []
    monkeypatch.setattr(metrics, "set_advised_chunk", lambda model, tokens: published.append((model, tokens)))
    write_steps(client.store, WORKED_SOURCE, worked_steps())
    a = client.get(URL, params={"itl_target_ms": 50}, headers=RD).json()
    assert published == [("worked-example", a["prefill_tokens_per_step"])]


def test_the_advised_chunk_is_the_prometheus_gauge_on_metrics(client):
    write_steps(client.store, WORKED_SOURCE, worked_steps())
    a = client.get(URL, params={"itl_target_ms": 50}, headers=RD).json()
    text = client.get("/metrics", headers=RD).text
    line = f'chunkledger_advised_chunk_tokens{{model="worked-example"}} {float(a["prefill_tokens_per_step"])}'
    assert line in text


# -- the CLI -------------------------------------------------------------------------------------------


def test_cli_advise_reads_a_running_ledger_and_prints_the_table_and_json(ledger_server):
    steps = worked_steps()
    for i in range(0, len(steps), 1000):
        body = ev.encode_batch(WORKED_SOURCE, steps[i : i + 1000])
        assert httpx.post(f"{ledger_server.url}/v1/events", content=body).status_code == 200
    result = runner.invoke(cli_app, ["advise", "--itl-target-ms", "50", "--ledger", ledger_server.url])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "max_num_batched_tokens" in out and "long_prefill_token_threshold" in out
    assert "target 50 ms - decode 10.0 ms" in out
    assert "R² 0.99" in out and "3000 steps" in out
    result = runner.invoke(
        cli_app, ["advise", "--itl-target-ms", "50", "--ledger", ledger_server.url, "--format", "json"]
    )
    a = json.loads(result.output)
    assert a["prefill_budget_ms"] == pytest.approx(40.0, abs=0.3)
    assert f"max_num_batched_tokens        {a['settings']['max_num_batched_tokens']}\n" in out
    refused = runner.invoke(cli_app, ["advise", "--itl-target-ms", "5", "--ledger", ledger_server.url])
    assert refused.exit_code == 1
    assert refused.output.startswith("no advice (target_unreachable)")
    assert "decode:" in refused.output  # what the data does say comes with the refusal


def test_cli_advise_reads_a_database_directly_with_db(tmp_path):
    url = f"duckdb:///{tmp_path / 'ledger.duckdb'}"
    store = open_store(url)
    write_steps(store, MEASURED_SOURCE, measured_steps())
    store.close()
    result = runner.invoke(cli_app, ["advise", "--itl-target-ms", "150", "--db", url])
    assert result.exit_code == 0, result.output
    assert "advice at prefill depth 16384" in result.output
    refused = runner.invoke(cli_app, ["advise", "--itl-target-ms", "50", "--db", url])
    assert refused.exit_code == 1
    assert "needs ~" in refused.output and "below the smallest step seen (256)" in refused.output


def test_cli_advise_explains_an_unreachable_ledger_and_bad_options():
    result = runner.invoke(cli_app, ["advise", "--itl-target-ms", "50", "--ledger", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "cannot reach the ledger" in result.output
    result = runner.invoke(cli_app, ["advise", "--itl-target-ms", "50", "--format", "xml"])
    assert result.exit_code == 2 and "--format must be table or json" in result.output


def test_advice_recovers_the_fleet_simulators_step_cost_through_exporter_and_ledger(ledger_server, tmp_path):
    """End to end: simulated engines (chunked long prompts, preemptions, mixed steps) report through
    the real exporter to a real ledger; the fit must find the simulator's own cost model."""
    from engine_hooks.simulator import SCENARIOS, run_simulation

    summary = run_simulation(
        engines=1,
        rps=6.0,
        duration_s=20.0,
        scenario="long-prompts",
        ledger_url=ledger_server.url,
        spool_dir=str(tmp_path / "spool"),
        pace=False,
        overrides={"spool_fsync": False, "flush_interval_s": 0.01},
    )
    assert summary["exporter"]["dropped"] == {}
    result = runner.invoke(
        cli_app, ["advise", "--itl-target-ms", "50", "--ledger", ledger_server.url, "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    a = json.loads(result.stdout)
    sc = SCENARIOS["long-prompts"]
    got = {c["term"]: c["ms_per_unit"] / 1e3 for c in a["fit"]["coefficients"]}
    assert set(got) == {"intercept", "prefill_tokens", "prefill_depth_tokens", "num_decode_reqs"}
    assert got["intercept"] == pytest.approx(sc.step_a_s, rel=1e-6)
    assert got["prefill_tokens"] == pytest.approx(sc.step_b_s, rel=1e-6)
    assert got["prefill_depth_tokens"] == pytest.approx(sc.step_c_s, rel=1e-6)
    assert got["num_decode_reqs"] == pytest.approx(sc.step_d_s, rel=1e-6)
    # Noise-free steps: the advised chunk is exactly what the cost model allows at the p99 depth.
    b99, depth = a["load"]["decode_batch_p99"], a["depth"]
    budget_s = 0.050 - sc.step_a_s - sc.step_d_s * b99
    want = int(budget_s / (sc.step_b_s + sc.step_c_s * depth))
    assert want < a["fit"]["covers"]["prefill_tokens"][1]  # within the data: not capped
    assert abs(a["prefill_tokens_per_step"] - want) <= 1


def test_cli_advise_refuses_an_option_outside_the_querys_bounds_before_asking():
    result = runner.invoke(cli_app, ["advise", "--itl-target-ms", "0", "--ledger", "http://127.0.0.1:9"])
    assert result.exit_code == 2 and "itl_target_ms" in result.output
    result = runner.invoke(
        cli_app, ["advise", "--itl-target-ms", "50", "--arrival-share", "1", "--ledger", "http://127.0.0.1:9"]
    )
    assert result.exit_code == 2 and "arrival_share" in result.output
