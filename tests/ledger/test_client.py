"""``LedgerClient``: the one HTTP client of the ledger's API, against a real ledger."""

from __future__ import annotations

import ast

import pytest

from ledger.client import LedgerClient, LedgerError
from tests.support import ROOT


def test_errors_carry_the_status_the_ledgers_reason_and_a_readable_detail(ledger_server):
    with LedgerClient(ledger_server.url) as client:
        with pytest.raises(LedgerError) as refused:
            client.post("/v1/sql", {"sql": "DELETE FROM requests"})
        assert refused.value.status_code == 400 and refused.value.reason == "not_read_only"
        assert refused.value.label == "400 not_read_only" and "DELETE" in refused.value.detail
        with pytest.raises(LedgerError) as invalid:  # FastAPI's validation list, flattened
            client.post("/v1/sql", {"sql": ""})
        assert invalid.value.label == "422 invalid" and invalid.value.detail.startswith("sql: ")
        with pytest.raises(LedgerError) as missing:
            client.get("/v1/requests/nope")
        assert missing.value.status_code == 404 and "nope" in missing.value.detail
        assert not missing.value.unreachable


def test_an_unreachable_ledger_is_an_error_without_a_status():
    with LedgerClient("http://127.0.0.1:9", timeout_s=2) as client, pytest.raises(LedgerError) as down:
        client.get("/v1/sources")
    assert down.value.unreachable and "cannot reach the ledger at http://127.0.0.1:9" in str(down.value)


def test_stream_reads_a_body_as_it_arrives_and_raises_on_an_error_status(ledger_server):
    with LedgerClient(ledger_server.url) as client:
        with client.stream("/v1/export/sources.parquet", since=0) as r:
            assert b"".join(r.iter_bytes()).startswith(b"PAR1")
        with pytest.raises(LedgerError) as bad, client.stream("/v1/export/users.parquet", since=0):
            pass
        assert bad.value.status_code is not None and bad.value.status_code >= 400


def test_the_url_and_token_come_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.delenv("CHUNKLEDGER_LEDGER_URL", raising=False)
    monkeypatch.setenv("CHUNKLEDGER_URL", "http://exporter-url:1/")
    monkeypatch.setenv("CHUNKLEDGER_ADMIN_TOKEN", "adm")
    with LedgerClient(token_env="CHUNKLEDGER_ADMIN_TOKEN") as client:
        assert client.url == "http://exporter-url:1"
        assert client._http.headers["authorization"] == "Bearer adm"
    monkeypatch.setenv("CHUNKLEDGER_LEDGER_URL", "http://ledger-url:2")
    with LedgerClient() as client:
        assert client.url == "http://ledger-url:2"


def test_only_the_client_talks_http_to_the_ledger():
    """The ledger's other modules and the dashboard reach the API through LedgerClient; httpx elsewhere
    in the ledger is the webhook delivery (to subscribers, not to the ledger) and the OTLP trace export
    (to the trace backend)."""
    allowed = {"ledger/client.py"}
    offenders = []
    for package in ("chunkledger", "ledger", "dashboard"):
        for path in (ROOT / package).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel in allowed or rel.startswith("ledger/webhooks/") or rel == "ledger/traces/otlp.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                if any(n.split(".")[0] == "httpx" for n in names):
                    offenders.append(rel)
    assert not offenders, f"HTTP clients besides ledger/client.py: {sorted(set(offenders))}"
