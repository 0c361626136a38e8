"""Prometheus metrics of the ledger service, on a per-app ``CollectorRegistry`` (tests get fresh ones).

Names carry the ``chunkledger_`` prefix and base units; counters end in ``_total``; labels come from
small sets only (model, source, kind, rule, action, layer, reason, channel, event_type): never a request
id. The labels whose values sources choose (model, source, a dropped marker's reason) are bounded by
``ledger.metric_labels``: capped in length and count, the rest folded into ``other`` and counted.
Latency histograms are observed once per finished request, from its ``requests`` view row, a few
seconds after the engine finished it (so the gateway's end has landed). Gauges about live requests are
read from the rule engine when Prometheus scrapes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector

from ledger.metric_labels import OVERFLOW_REASONS, LabelValues
from ledger.rules.rules import RULE_NAMES
from ledger.rules.slo import itl_of
from ledger.traces.spans import derived_id

LAYERS = ("entry", "admission", "backend_wait", "frontend", "engine_queue", "prefill", "decode", "delivery")
_RULE_ACTIONS = {
    "preemption_limit": ("slow_pool", "non_preemptible"),
    "forced_wait_limit": ("slow_pool", "non_preemptible"),
    "slow_pool_starved": ("promote",),
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_EXEMPLAR_MAX_CHARS = 128  # OpenMetrics: an exemplar's label names and values together
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)

# The limits ledger.api.gate refuses or abandons a request by (chunkledger_request_refusals_total).
REFUSAL_LIMITS = (
    "not_loopback",
    "content_type",
    "auth_failures_per_minute",
    "read_max_concurrent",
    "read_max_concurrent_per_client",
    "send_timeout_s",
)

_instances: weakref.WeakSet[LedgerMetrics] = weakref.WeakSet()


class _LiveCollector(Collector):
    """Gauges computed at scrape time from the rule engine."""

    def __init__(self, models: LabelValues) -> None:
        self.models = models
        self.live: Callable[[], dict[str, int]] = dict
        self.stalled: Callable[[], dict[str, int]] = dict
        self.stall_max: Callable[[], dict[str, float]] = dict
        self.outbox: Callable[[], int] = lambda: 0

    def collect(self):  # type: ignore[no-untyped-def]
        g = GaugeMetricFamily(
            "chunkledger_live_requests", "Requests the rule engine tracks (not finished)", labels=["model"]
        )
        models = self.models
        for m, n in sorted(models.fold(self.live(), _add).items()):
            g.add_metric([m], n)
        yield g
        g = GaugeMetricFamily(
            "chunkledger_kv_stalled_requests",
            "Requests holding KV blocks that got no token in their engine's latest step",
            labels=["model"],
        )
        for m, n in sorted(models.fold(self.stalled(), _add).items()):
            g.add_metric([m], n)
        yield g
        g = GaugeMetricFamily(
            "chunkledger_kv_stall_max_seconds",
            "Longest time a live request has gone without a new token",
            labels=["model"],
        )
        for m, s in sorted(models.fold(self.stall_max(), max).items()):
            g.add_metric([m], s)
        yield g
        yield GaugeMetricFamily(
            "chunkledger_webhook_outbox_pending", "Webhook deliveries waiting to be sent", value=self.outbox()
        )


def _add(a: int, b: int) -> int:
    return a + b


TRACE_DROP_REASONS = ("export_failed", "queue_full", "request_queue_full", "read_failed")


class LedgerMetrics:
    """The ledger's metrics. ``max_models``, ``max_sources``, ``max_reasons``: how many distinct values
    of those labels get series of their own; ``max_label_length``: the longest value exported as is."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        max_models: int = 8,
        max_sources: int = 64,
        max_reasons: int = 8,
        max_label_length: int = 128,
    ) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        overflow = self._overflow
        self.models = LabelValues("model", cap=max_models, max_length=max_label_length, on_overflow=overflow)
        self.sources = LabelValues(
            "source", cap=max_sources, max_length=max_label_length, on_overflow=overflow
        )
        self.reasons = LabelValues(
            "reason", cap=max_reasons, max_length=max_label_length, on_overflow=overflow
        )
        # Registered in this order (the exposition follows it).
        self._requests(r)
        self._commands(r)
        self._webhooks(r)
        self._ingest(r)
        self._service(r)
        self._traces(r)
        self.live = _LiveCollector(self.models)
        r.register(self.live)
        # Registered after the live gauges, whose values are folded while a scrape collects them: the
        # same scrape shows what they folded.
        self.label_overflow = Counter(
            "chunkledger_metric_label_overflow_total",
            "Label values sources sent that were exported as 'other' (reason: too_many distinct values, "
            "too_long, invalid: control characters)",
            ["label", "reason"],
            registry=r,
        )
        self._prime_labels()
        _instances.add(self)

    def _requests(self, r: CollectorRegistry) -> None:
        """Per finished request: the latency histograms and the count."""
        self.layer_seconds = Histogram(
            "chunkledger_request_layer_seconds",
            "Per-request time in each layer (entry, admission, backend_wait = frontend + engine_queue, "
            "prefill, decode; delivery: the first token's way back to the client)",
            ["model", "layer"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "chunkledger_ttft_seconds",
            "Time to first token per request (arrival -> the engine's first token)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.client_ttft_seconds = Histogram(
            "chunkledger_client_ttft_seconds",
            "Time to first token as the client saw it (gateway arrival -> first token written to it)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl_seconds = Histogram(
            "chunkledger_itl_seconds",
            "Mean inter-token latency per request (decode time / (output tokens - 1))",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            "chunkledger_e2e_seconds",
            "End-to-end time per request",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests_finished = Counter(
            "chunkledger_requests_finished_total", "Requests observed finished", ["model"], registry=r
        )

    def _commands(self, r: CollectorRegistry) -> None:
        """Rule decisions and the commands that carry them to sources."""
        self.cutoffs = Counter(
            "chunkledger_cutoffs_total", "Rule decisions (commands issued)", ["rule", "action"], registry=r
        )
        self.commands_delivered = Counter(
            "chunkledger_commands_delivered_total",
            "Commands handed to a source (ingest response, long-poll or the stream's commands subject), "
            "re-sends included",
            ["channel"],
            registry=r,
        )
        self.commands_applied = Counter(
            "chunkledger_commands_applied_total",
            "Commands a source confirmed",
            ["rule", "target"],
            registry=r,
        )
        self.command_apply_seconds = Histogram(
            "chunkledger_command_apply_seconds",
            "Decision -> confirmation time of commands",
            ["target"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.commands_refused = Counter(
            "chunkledger_command_confirmations_refused_total",
            "Confirmations (cutoff_applied, stream_cut) of a command from a source it was not sent to: "
            "ignored",
            registry=r,
        )
        self.commands_expired = Counter(
            "chunkledger_commands_expired_total", "Commands given up unconfirmed after their ttl", registry=r
        )

    def _webhooks(self, r: CollectorRegistry) -> None:
        """Alerts and their webhook deliveries."""
        self.webhook_attempts = Counter(
            "chunkledger_webhook_attempts_total", "Webhook delivery attempts", ["event_type"], registry=r
        )
        self.webhook_failures = Counter(
            "chunkledger_webhook_failures_total",
            "Failed webhook delivery attempts (reason: status, timeout, connect)",
            ["event_type", "reason"],
            registry=r,
        )
        self.webhook_dead = Counter(
            "chunkledger_webhook_dead_letters_total",
            "Webhook deliveries given up after the last attempt",
            ["event_type"],
            registry=r,
        )
        self.alerts = Counter(
            "chunkledger_alerts_total", "Alerts raised (webhook event types)", ["event_type"], registry=r
        )

    def _ingest(self, r: CollectorRegistry) -> None:
        """What sources sent, what was stored or refused, and how long storing took."""
        self.ingest_events = Counter(
            "chunkledger_ingest_events_total", "Events stored (new, not duplicates)", ["source"], registry=r
        )
        self.ingest_duplicates = Counter(
            "chunkledger_ingest_duplicates_total",
            "Events received again and not stored twice",
            ["source"],
            registry=r,
        )
        self.ingest_batches = Counter(
            "chunkledger_ingest_batches_total", "Batches stored", ["source"], registry=r
        )
        self.ingest_rejections = Counter(
            "chunkledger_ingest_rejections_total",
            "Batches refused (reason: invalid, too_large, unavailable, fenced: another producer owns the "
            "source id, conflicting_replay: a seq already stored with other content, not_request_owner: "
            "events about requests another source serves, rate_limited: the source is over its ingest "
            "limits)",
            ["reason"],
            registry=r,
        )
        self.ingest_future_timestamps = Counter(
            "chunkledger_ingest_future_timestamps_total",
            "Events stamped further ahead of the ledger's clock than max_clock_ahead_s, stored with the "
            "receive time instead (a source's clock is wrong)",
            ["source"],
            registry=r,
        )
        self.source_dropped = Counter(
            "chunkledger_source_dropped_events_total",
            "Events sources reported as dropped",
            ["source", "reason"],
            registry=r,
        )
        self.ingest_group_seconds = Histogram(
            "chunkledger_ingest_group_seconds",
            "Time to store one group commit (the batches queued together), first statement to commit",
            buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.rule_intake_seconds = Histogram(
            "chunkledger_rule_intake_seconds",
            "Batch read by the ingest endpoint -> observed by the rule engine, its counter rules decided "
            "(a cutoff that a batch's tokens call for is decided within this time of its arrival)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
            registry=r,
        )
        self.ingest_group_events = Histogram(
            "chunkledger_ingest_group_events",
            "Events per group commit",
            buckets=(10, 50, 100, 500, 1000, 5000, 10_000, 50_000),
            registry=r,
        )

    def _service(self, r: CollectorRegistry) -> None:
        """The service itself: advice published, event-loop stalls, refusals at the door, token checks."""
        self.advised_chunk_tokens = Gauge(
            "chunkledger_advised_chunk_tokens",
            "Advised prefill chunk size (tokens per step) from the chunk-size advice",
            ["model"],
            registry=r,
        )
        self.event_loop_stalls = Counter(
            "chunkledger_event_loop_stalls_total",
            "Times the ledger's event loop did not turn for over a second (every request waited)",
            registry=r,
        )
        self.event_loop_stall_seconds = Counter(
            "chunkledger_event_loop_stall_seconds_total", "Time the event loop spent blocked", registry=r
        )
        self.request_refusals = Counter(
            "chunkledger_request_refusals_total",
            "Requests refused or abandoned by a limit at the door (reason: the limit, e.g. "
            "read_max_concurrent, send_timeout_s, content_type, not_loopback)",
            ["reason"],
            registry=r,
        )
        self.auth_failures = Counter(
            "chunkledger_auth_failures_total",
            "Failed token checks (reason: missing_token, unknown_token, forbidden; limited: refused "
            "because the address failed too often)",
            ["reason"],
            registry=r,
        )

    def _traces(self, r: CollectorRegistry) -> None:
        """OTLP export of finished requests (``ledger.traces``): spans sent, batches tried, spans lost."""
        self.trace_spans_exported_total = Counter(
            "chunkledger_trace_spans_exported_total", "Spans the OTLP endpoint accepted", registry=r
        )
        self.trace_exports = Counter(
            "chunkledger_trace_exports_total", "OTLP export requests (batches) attempted", registry=r
        )
        self.trace_export_failures = Counter(
            "chunkledger_trace_export_failures_total",
            "OTLP export requests the exporter gave up on (after its retries)",
            registry=r,
        )
        self.trace_spans_dropped_total = Counter(
            "chunkledger_trace_spans_dropped_total",
            "Spans not exported (reason: export_failed, the endpoint did not take them in time; queue_full, "
            "the span queue was full; request_queue_full and read_failed count requests, not spans)",
            ["reason"],
            registry=r,
        )
        self._trace_dropped = {
            reason: self.trace_spans_dropped_total.labels(reason) for reason in TRACE_DROP_REASONS
        }

    def trace_spans_exported(self, n: int) -> None:
        self.trace_spans_exported_total.inc(n)

    def trace_spans_dropped(self, reason: str, n: int) -> None:
        self._trace_dropped[reason].inc(n)

    def trace_export_attempt(self, ok: bool) -> None:
        self.trace_exports.inc()
        if not ok:
            self.trace_export_failures.inc()

    def _prime_labels(self) -> None:
        """Every known label value at 0 from the start, so a rate() sees the first increment."""
        for rule in RULE_NAMES:
            for action in _RULE_ACTIONS.get(rule, ("abort",)):
                self.cutoffs.labels(rule, action)
        for reason in (
            "invalid",
            "too_large",
            "unavailable",
            "fenced",
            "conflicting_replay",
            "not_request_owner",
            "rate_limited",
        ):
            self.ingest_rejections.labels(reason)
        for limit in REFUSAL_LIMITS:
            self.request_refusals.labels(limit)
        for reason in ("missing_token", "unknown_token", "forbidden", "limited"):
            self.auth_failures.labels(reason)
        for ch in ("ingest", "poll", "stream"):
            self.commands_delivered.labels(ch)
        for label in ("model", "source", "reason"):
            for why in OVERFLOW_REASONS:
                self.label_overflow.labels(label, why)

    def _overflow(self, label: str, reason: str) -> None:
        self.label_overflow.labels(label, reason).inc()

    def render(self, openmetrics: bool = False) -> bytes:
        """The exposition: Prometheus text, or OpenMetrics (``openmetrics``), which carries exemplars."""
        if openmetrics:
            return generate_openmetrics(self.registry)
        return generate_latest(self.registry)

    def observe_request(self, row: dict[str, object]) -> None:
        """Latency histograms from one finished request's ``requests`` view row; the TTFT, e2e and layer
        buckets it lands in get it as their exemplar (:func:`exemplar_of`)."""
        model = self.models(str(row.get("model") or ""))
        exemplar = exemplar_of(row)
        for layer in LAYERS:
            v = row.get(f"{layer}_s")
            if isinstance(v, (int, float)) and v >= 0:
                self.layer_seconds.labels(model, layer).observe(v, exemplar)
        ttft = row.get("ttft_s")
        if isinstance(ttft, (int, float)) and ttft >= 0:
            self.ttft_seconds.labels(model).observe(ttft, exemplar)
        client_ttft = row.get("client_ttft_s")
        if isinstance(client_ttft, (int, float)) and client_ttft >= 0:
            self.client_ttft_seconds.labels(model).observe(client_ttft, exemplar)
        e2e = row.get("e2e_s")
        if isinstance(e2e, (int, float)) and e2e >= 0:
            self.e2e_seconds.labels(model).observe(e2e, exemplar)
        itl = itl_of(row)
        if itl is not None:
            self.itl_seconds.labels(model).observe(itl)
        self.requests_finished.labels(model).inc()


def exemplar_of(row: dict[str, object]) -> dict[str, str] | None:
    """A finished request as an exemplar: ``trace_id`` (its W3C trace, or the one the OTLP export gives
    a request that came without one, derived from its id) and ``request_id`` when the two fit
    OpenMetrics' 128 characters of exemplar label names and values (a request id over 78 characters is
    left out: a cut one would open no request)."""
    rid = row.get("request_id")
    if rid is None:
        return None
    rid = str(rid)
    trace = str(row.get("trace_id") or derived_id(rid, "trace", 16))
    labels = {"trace_id": trace}
    if len("request_id") + len(rid) + len("trace_id") + len(trace) <= _EXEMPLAR_MAX_CHARS:
        labels["request_id"] = rid
    return labels


def set_advised_chunk(model: str, tokens: int) -> None:
    """Publish the advised chunk size for ``model`` on every live ledger's registry."""
    for m in list(_instances):
        m.advised_chunk_tokens.labels(m.models(model)).set(tokens)
