"""The W3C trace context a request reached vLLM with, as the plugin reports it on ``queued``."""

from __future__ import annotations

from typing import Any

from engine_hooks.events import XARGS_KEY
from engine_hooks.tracecontext import TRACEPARENT, parse_traceparent


def request_trace(request: Any) -> tuple[str | None, str | None]:
    """The W3C trace (trace id, the sender's span id) vLLM received with the request, for ``queued``;
    (None, None) when it came through the gateway (its ``XARGS_KEY`` in ``extra_args``: the gateway
    reports the trace and its own span, which is the parent vLLM received) or carries no valid
    ``traceparent``. vLLM's OpenAI server hands the engine the trace headers only when it runs with
    ``--otlp-traces-endpoint``."""
    headers = getattr(request, "trace_headers", None)
    if not headers:
        return None, None
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    if extra and XARGS_KEY in extra:
        return None, None
    parent = parse_traceparent(headers.get(TRACEPARENT))
    if parent is None:
        return None, None
    return parent.trace_id, parent.span_id
