"""The gateway answers vLLM's own routes as vLLM does (clients such as GuideLLM probe ``GET /health``)."""

from __future__ import annotations

import httpx

from bench.toolkit import free_port


def test_health_is_the_engines_health_relayed(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        ok = client.get(gw.url + "/health")
        dead = client.get(gw.url + "/health", headers={"x-fake": "engine-dead"})
    assert (ok.status_code, ok.content) == (200, b"")
    assert (dead.status_code, dead.content) == (503, b"")
    assert [r.path for r in upstream.app.requests] == ["/health", "/health"]


def test_health_without_an_upstream_is_503_and_healthz_stays_the_gateways(make_gateway):
    gw = make_gateway(f"http://127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    with httpx.Client() as client:
        health = client.get(gw.url + "/health")
        healthz = client.get(gw.url + "/healthz")
    assert (health.status_code, health.content) == (503, b"")
    assert (healthz.status_code, healthz.json()) == (200, {"status": "ok"})


def test_other_vllm_routes_are_relayed_and_counted(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        version = client.get(gw.url + "/version")
        wrong = client.post(gw.url + "/version")
        metrics = client.get(gw.url + "/metrics").text
    assert version.status_code == 200 and version.json() == {"version": "0.0.0-fake"}
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET"
    assert "/version takes GET" in wrong.json()["error"]["message"]
    assert [r.path for r in upstream.app.requests] == ["/version"]  # the 405 did not go upstream
    assert 'chunkledger_gateway_requests_total{endpoint="vllm_routes"} 1.0' in metrics


def test_routes_vllm_does_not_have_stay_404(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        r = client.get(gw.url + "/collective_rpc")
    assert r.status_code == 404
    assert upstream.app.requests == []
