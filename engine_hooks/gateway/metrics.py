"""Prometheus metrics of one gateway, in its own ``CollectorRegistry`` (served at ``/metrics``).

Names follow the project's rules: prefix ``chunkledger_gateway_``, base units, ``_total`` on counters,
labels only from small fixed sets (pre-created so every series starts at 0, bound once). Queue depth
and in-flight requests are read from the admission queue at scrape time, so the hot path pays nothing
for them.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ENDPOINTS = ("completions", "chat_completions", "models", "vllm_routes")
OUTCOMES = (
    "completed",  # the upstream answer was relayed to the end (any upstream status)
    "rejected_queue_full",  # 429: the admission queue was full
    "rejected_wait_timeout",  # 503: waited longer than the admission bound
    "bad_request",  # 400: the gateway could not read the request
    "duplicate_request_id",  # 409: the client's X-Request-Id is in flight here already
    "upstream_unreachable",  # 502: could not connect to the upstream
    "upstream_timeout",  # 504, or a stream ended by the read timeout
    "upstream_error",  # the upstream connection broke mid-response
    "client_disconnected",  # the client went away first; the upstream request was aborted
    "stream_cut",  # ended by a cutoff command from the ledger
)
UPSTREAM_ERRORS = ("unreachable", "timeout", "broken", "status_5xx")
_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        depth: Callable[[], float],
        in_flight: Callable[[], float],
        max_in_flight: int,
    ):
        p = "chunkledger_gateway_"
        self.registry = registry
        queue_depth = Gauge(
            p + "admission_queue_depth", "Requests waiting for an upstream slot", registry=registry
        )
        queue_depth.set_function(depth)
        upstream = Gauge(
            p + "in_flight_requests", "Requests forwarded upstream and not finished", registry=registry
        )
        upstream.set_function(in_flight)
        limit = Gauge(
            p + "max_in_flight_requests", "Configured upstream concurrency limit", registry=registry
        )
        limit.set(max_in_flight)
        requests = Counter(p + "requests", "Requests received, by endpoint", ["endpoint"], registry=registry)
        self.requests = {e: requests.labels(e) for e in ENDPOINTS}
        finished = Counter(
            p + "requests_finished", "Requests finished, by outcome", ["outcome"], registry=registry
        )
        self.finished = {o: finished.labels(o) for o in OUTCOMES}
        self.admission_wait = Histogram(
            p + "admission_wait_seconds",
            "Time admitted requests spent in the admission queue",
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.upstream_requests = Counter(
            p + "upstream_requests", "Requests sent to the upstream (attempts)", registry=registry
        )
        errors = Counter(
            p + "upstream_errors", "Upstream requests that failed, by reason", ["reason"], registry=registry
        )
        self.upstream_errors = {r: errors.labels(r) for r in UPSTREAM_ERRORS}
        self.first_byte = Histogram(
            p + "time_to_first_byte_seconds",
            "Arrival at the gateway to the first upstream response byte",
            buckets=_TTFB_BUCKETS,
            registry=registry,
        )
        self.first_token = Histogram(
            p + "time_to_first_token_seconds",
            "Arrival at the gateway to the first generated content written to the client",
            buckets=_TTFB_BUCKETS,
            registry=registry,
        )
        self.commands = Counter(p + "commands", "Cutoff commands received from the ledger", registry=registry)
        self.commands_applied = Counter(
            p + "commands_applied",
            "Cutoff commands applied to a request this gateway held",
            registry=registry,
        )
