"""The analytics commands read a running ledger over HTTP and print tails first."""

from __future__ import annotations

import json

import httpx
from typer.testing import CliRunner

from chunkledger.main import app
from engine_hooks import events as ev
from tests.ledger.analytics.test_analytics import scene
from tests.support.factories import ENGINE

runner = CliRunner()


def _run(server, *args: str):
    result = runner.invoke(app, [*args, "--ledger", server.url])
    assert result.exit_code == 0, result.output
    return result.output


def test_cli_prints_tails_lists_requests_and_explains_a_slow_one(ledger_server):
    r = httpx.post(f"{ledger_server.url}/v1/events", content=ev.encode_batch(ENGINE, scene()))
    assert r.status_code == 200, r.text
    out = _run(ledger_server, "attribution", "--since", "0")
    assert "2 requests" in out and "p99" in out and "mean" in out
    assert out.index("p99") < out.index("mean")  # the mean only ever right of the p99
    assert "decode ITL" in out
    listed = _run(ledger_server, "requests", "--sort", "prompt_tokens")
    assert listed.splitlines()[2].startswith("long")
    why = _run(ledger_server, "why", "short")
    assert "engine_queue" in why and "- long: 1536 prefill tokens" in why
    stalls = json.loads(_run(ledger_server, "stalls", "--format", "json"))
    assert stalls["requests"] == []  # the scene happened long ago: beyond the live horizon


def test_cli_reports_ledger_errors_without_a_traceback(ledger_server):
    result = runner.invoke(app, ["requests", "--sort", "nope", "--ledger", ledger_server.url])
    assert result.exit_code == 1
    assert "422" in result.output and "sort" in result.output
    result = runner.invoke(app, ["why", "r", "--ledger", "http://127.0.0.1:9"])
    assert result.exit_code == 1 and "cannot reach the ledger" in result.output


def test_cli_why_asks_the_ledger_for_top_culprits_and_refuses_a_top_out_of_the_querys_bounds(ledger_server):
    r = httpx.post(f"{ledger_server.url}/v1/events", content=ev.encode_batch(ENGINE, scene()))
    assert r.status_code == 200, r.text
    out = json.loads(_run(ledger_server, "why", "dec", "--top", "1", "--format", "json"))
    assert out["items"] and all(len(i["culprits"]) <= 1 for i in out["items"])
    refused = runner.invoke(app, ["why", "dec", "--top", "51", "--ledger", ledger_server.url])
    assert refused.exit_code == 2 and "top" in refused.output
