"""The trace context the plugin reports on ``queued``: what vLLM received, unless the gateway sent it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine_hooks.events import XARGS_KEY
from engine_hooks.vllm.tracing import request_trace

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _request(headers, extra_args=None):
    return SimpleNamespace(trace_headers=headers, sampling_params=SimpleNamespace(extra_args=extra_args))


def test_the_context_vllm_received_is_reported():
    assert request_trace(_request({"traceparent": f"00-{TRACE}-{SPAN}-01"})) == (TRACE, SPAN)


@pytest.mark.parametrize(
    "request_",
    [
        _request(None),
        _request({}),
        _request({"traceparent": "garbage"}),
        _request({"traceparent": f"00-{TRACE}-{SPAN}-01"}, {XARGS_KEY: "gw-1"}),  # the gateway reports it
        SimpleNamespace(sampling_params=None),  # a vLLM without trace_headers on its Request
    ],
)
def test_nothing_is_reported_without_a_valid_context_or_with_a_gateway(request_):
    assert request_trace(request_) == (None, None)
