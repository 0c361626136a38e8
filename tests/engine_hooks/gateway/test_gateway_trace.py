"""W3C trace context through the gateway: the client's trace (or a new one) goes upstream with the
gateway's span as the engine's parent, and to the ledger on ``arrived``."""

from __future__ import annotations

import httpx

from engine_hooks.tracecontext import parse_traceparent
from tests.engine_hooks.gateway.gateway_helpers import events_of

TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
BODY = {"model": "m", "stream": True, "max_tokens": 2}


def _send(gw, headers: dict[str, str]) -> httpx.Response:
    with httpx.Client(timeout=10) as client:
        return client.post(gw.url + "/v1/completions", json=BODY, headers=headers)


def test_the_clients_trace_goes_upstream_under_the_gateways_span(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    headers = {
        "x-request-id": "traced",
        "traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01",
        "tracestate": "rojo=1",
    }
    assert _send(gw, headers).status_code == 200
    gw.flush()
    sent = upstream.app.requests[-1].headers
    parent = parse_traceparent(sent["traceparent"])
    assert parent is not None and parent.trace_id == TRACE and parent.flags == 1
    assert parent.span_id != CLIENT_SPAN  # the gateway's own span is the engine's parent
    assert sent["tracestate"] == "rojo=1"
    arrived = events_of(fake_ledger, "traced")[0]
    assert (arrived.trace_id, arrived.parent_span_id, arrived.span_id) == (TRACE, CLIENT_SPAN, parent.span_id)


def test_without_a_valid_traceparent_the_gateway_starts_a_trace(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    assert _send(gw, {"x-request-id": "fresh"}).status_code == 200
    bad = {"x-request-id": "bad", "traceparent": f"00-{'0' * 32}-{CLIENT_SPAN}-01", "tracestate": "rojo=1"}
    assert _send(gw, bad).status_code == 200  # an invalid header is ignored, as the standard asks
    gw.flush()
    traces = []
    for rid, recorded in zip(("fresh", "bad"), upstream.app.requests[-2:], strict=True):
        parent = parse_traceparent(recorded.headers["traceparent"])
        assert parent is not None
        assert "tracestate" not in recorded.headers  # it travels only with a valid traceparent
        arrived = events_of(fake_ledger, rid)[0]
        assert (arrived.trace_id, arrived.parent_span_id, arrived.span_id) == (
            parent.trace_id,
            None,
            parent.span_id,
        )
        traces.append(parent.trace_id)
    assert traces[0] != traces[1]


def test_a_refused_request_keeps_its_trace(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    headers = {"x-request-id": "refused", "traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"}
    with httpx.Client(timeout=10) as client:
        r = client.post(gw.url + "/v1/completions", content=b"not json", headers=headers)
    assert r.status_code == 400
    gw.flush()
    arrived = events_of(fake_ledger, "refused")[0]
    assert (arrived.trace_id, arrived.parent_span_id) == (TRACE, CLIENT_SPAN)
    assert upstream.app.requests == []
