"""The gateway's layers land in the real ledger (``chunkledger serve`` in a subprocess, DuckDB file)."""

from __future__ import annotations

import httpx


def test_gateway_layers_appear_in_the_ledger_row(upstream, make_gateway, ledger_server):
    gw = make_gateway(upstream.url, ledger_url=ledger_server.url)
    with httpx.Client(timeout=10) as client:
        r = client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 4},
            headers={"x-request-id": "ledger-row-1", "x-fake-delay-ms": "10"},
        )
        assert r.status_code == 200
        refused = client.post(
            gw.url + "/v1/completions", content=b"[]", headers={"x-request-id": "ledger-bad"}
        )
        assert refused.status_code == 400
        gw.flush()
        answer = client.get(f"{ledger_server.url}/v1/requests/ledger-row-1")
        bad = client.get(f"{ledger_server.url}/v1/requests/ledger-bad").json()["request"]
    assert answer.status_code == 200
    row, events = answer.json()["request"], answer.json()["events"]
    assert row["gateway_source_id"] == "gw-test"
    for column in ("arrived_ts", "admission_enqueued_ts", "admitted_ts", "first_byte_ts", "completed_ts"):
        assert row[column] is not None, column
    assert row["arrived_ts"] <= row["admission_enqueued_ts"] <= row["admitted_ts"] <= row["completed_ts"]
    assert row["status_code"] == 200
    assert row["entry_measured_s"] >= 0 and row["admission_wait_s"] == 0
    kinds = [e["kind"] for e in events]
    assert kinds == [
        "arrived",
        "admission_enqueued",
        "admitted",
        "first_byte",
        "first_token_out",
        "completed",
    ]
    # what the client saw: first and last content out, within the exchange
    assert row["first_byte_ts"] <= row["first_token_out_ts"] < row["last_token_out_ts"] <= row["completed_ts"]
    assert 0 < row["client_ttft_s"] <= row["e2e_s"]
    assert row["ttft_s"] == row["client_ttft_s"]  # no engine events: the first token out is the first token
    assert bad["status_code"] == 400 and bad["admitted_ts"] is None


def test_ledger_cutoff_reaches_the_gateway_by_long_poll_and_cuts_the_stream(
    upstream, make_gateway, ledger_server, tmp_path
):
    """The ledger decides a token-cap cut from (simulated) engine events; the gateway, which emits
    nothing mid-stream, learns of it through GET /v1/commands and cuts the stream it is relaying."""
    from engine_hooks.config import ExporterConfig
    from engine_hooks.events import Queued, Tokens
    from engine_hooks.exporter import Exporter

    with httpx.Client(timeout=10) as client:
        policy = client.put(f"{ledger_server.url}/v1/policy", json={"rules": {"max_output_tokens": 5}})
        assert policy.status_code == 200, policy.text
    gw = make_gateway(upstream.url, ledger_url=ledger_server.url, command_poll_wait_s=5)
    engine = Exporter(
        ExporterConfig.create(
            url=ledger_server.url,
            source_id="engine-fake",
            source_kind="engine",
            model="m",
            spool_dir=str(tmp_path / "engine-spool"),
            spool_fsync=False,
            flush_interval_s=0.01,
        )
    )
    body = b""
    try:
        with (
            httpx.Client(timeout=20) as client,
            client.stream(
                "POST",
                gw.url + "/v1/chat/completions",
                json={"model": "m", "stream": True, "max_tokens": 2000},
                headers={"x-request-id": "e2e-cut", "x-fake-delay-ms": "10"},
            ) as response,
        ):
            for chunk in response.iter_raw():
                if not body:  # the engine reports more tokens than the ledger's cap
                    engine.emit(Queued, request_id="e2e-cut", prompt_tokens=12, max_tokens=2000)
                    engine.emit(Tokens, request_id="e2e-cut", count=8, total=8)
                body += chunk
    finally:
        engine.shutdown(5.0)
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert len(events) < 1000  # cut long before the 2000 tokens
    final = events[-2].decode()
    assert '"code":"token_cap"' in final and '"finish_reason":"cutoff"' in final
    gw.flush()
    with httpx.Client(timeout=10) as client:
        row = client.get(f"{ledger_server.url}/v1/requests/e2e-cut").json()["request"]
        cutoffs = client.get(f"{ledger_server.url}/v1/cutoffs", params={"request_id": "e2e-cut"}).json()[
            "cutoffs"
        ]
    assert row["cut_rule"] == "token_cap"
    assert row["stream_cut_ts"] is not None
    assert [(c["rule"], c["gateway_source_id"]) for c in cutoffs] == [("token_cap", "gw-test")]
    assert cutoffs[0]["gateway_applied_ts"] is not None  # the gateway confirmed (cutoff_applied)
