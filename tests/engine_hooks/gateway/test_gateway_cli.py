"""``chunkledger gateway`` as users run it: a subprocess in front of an upstream, sending to a ledger."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from bench.toolkit import free_port
from tests.engine_hooks.gateway.gateway_helpers import kinds_of
from tests.support.fake_ledger import wait_until


def test_cli_serves_the_proxy_and_sends_events_to_the_ledger(upstream, fake_ledger, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "CHUNKLEDGER_SPOOL_DIR": str(tmp_path / "spool"),
        "CHUNKLEDGER_FLUSH_INTERVAL_S": "0.01",
    }
    env.pop("CHUNKLEDGER_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chunkledger",
            "gateway",
            "--upstream",
            upstream.url,
            "--port",
            str(port),
            "--ledger",
            fake_ledger.url,
            "--source-id",
            "gw-cli",
            "--max-in-flight",
            "2",
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.1)
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 3},
            headers={"x-request-id": "via-cli"},
        )
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
        assert "chunkledger_gateway_max_in_flight_requests 2.0" in httpx.get(url + "/metrics").text
        assert wait_until(lambda: "completed" in kinds_of(fake_ledger, "via-cli"), timeout=10)
        assert {row[0] for row in fake_ledger.rows} == {"gw-cli"}
    finally:
        proc.terminate()
        proc.wait(15)


def test_cli_refuses_bad_settings_naming_them():
    result = subprocess.run(
        [sys.executable, "-m", "chunkledger", "gateway", "--upstream", "localhost:8000", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "upstream must start with http:// or https://" in result.stderr
