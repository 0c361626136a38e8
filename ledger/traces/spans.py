"""A finished request as spans: one request span with OpenTelemetry's GenAI attributes, a child span
per layer, a grandchild per preemption's idle time, prefill chunks and the cutoff as span events.

Pure functions of a ``requests`` view row and the request's stored events, so what a trace backend
shows is what the ledger's SQL says. The layer spans tile the request span: laid end to end from its
start (``start_ts``) with the view's own layer durations,

    entry | admission | frontend | engine queue (first wait) | prefill | decode

where the prefill and decode spans are the windows first scheduled -> first token -> end, which hold
the waits while preempted (``engine_queue_s``'s re-waits, each a ``preempted`` child span; the window
less its waits is ``prefill_s`` or ``decode_s``, set as ``chunkledger.layer_s``). Their durations add
up to ``e2e_s``, the request span's, to the float. Entry and admission are the gateway's: without one
they are left out (they are 0). The engine's wall clock places the preemptions and chunks; a stamp
outside its layer's window (two hosts' clocks) is clamped into it.

Ids: the trace is the row's ``trace_id`` (the caller's or the gateway's); a request without one gets a
trace id derived from its request id. The request span is the gateway's own span (``span_id``, the
parent vLLM received, so vLLM's ``llm_request`` span is its child) or, without a gateway, an id derived
from the request id, a child of the caller's span (``parent_span_id``). Child span ids are derived from
the request id and the span's name, so exporting a request twice gives the same spans.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

LAYERS = ("entry", "admission", "frontend", "engine_queue", "prefill", "decode")
# The event kinds a request's spans are built from (``events.kind``).
EVENT_KINDS = ("arrived", "chunk", "resumed", "finished", "stream_cut", "cutoff_applied")
_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}

Attributes = dict[str, str | int | float | bool | list[str]]


@dataclass
class SpanEvent:
    name: str
    ts: float  # unix seconds
    attributes: Attributes = field(default_factory=dict)


@dataclass
class Span:
    name: str
    span_id: str  # 16 hex digits
    parent_span_id: str | None
    start: float  # unix seconds
    end: float
    attributes: Attributes = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    server: bool = False  # SpanKind.SERVER (the request span), else INTERNAL
    error: str | None = None  # a status message: the span's status is ERROR


@dataclass
class RequestTrace:
    trace_id: str  # 32 hex digits
    spans: list[Span]  # the request span first


def derived_id(request_id: str, name: str, size: int) -> str:
    """``size`` bytes of hex from the request id and a name: stable across exports, never all zeros."""
    digest = hashlib.blake2b(f"{request_id}\0{name}".encode(), digest_size=size).hexdigest()
    return digest if digest.strip("0") else "1".rjust(2 * size, "0")


def _num(row: dict[str, Any], col: str) -> float:
    v = row.get(col)
    return float(v) if isinstance(v, (int, float)) else 0.0


def _clamp(ts: float, lo: float, hi: float) -> float:
    return min(max(ts, lo), hi)


def request_trace(row: dict[str, Any], events: list[dict[str, Any]]) -> RequestTrace | None:
    """The request's trace, or None while it is not complete (no ``e2e_s``).

    ``row``: the ``requests`` view's row; ``events``: its events as ``{"kind", "ts", **data}`` (any
    order; only :data:`EVENT_KINDS` are read)."""
    e2e, start = row.get("e2e_s"), row.get("start_ts")
    if not isinstance(e2e, (int, float)) or not isinstance(start, (int, float)):
        return None
    rid = str(row["request_id"])
    trace_id = row.get("trace_id") or derived_id(rid, "trace", 16)
    root_id = row.get("span_id") or derived_id(rid, "request", 8)
    events = sorted(events, key=lambda e: e["ts"])
    root = _request_span(row, events, root_id, float(start), float(start) + float(e2e))
    layers = _layer_spans(row, rid, root_id, float(start))
    idle = _idle_spans(rid, layers, events)
    prefill = next((s for s in layers if s.name == "prefill"), None)
    if prefill is not None:
        prefill.events = _chunk_events(events, prefill)
    return RequestTrace(trace_id, [root, *layers, *idle])


def _request_span(
    row: dict[str, Any], events: list[dict[str, Any]], span_id: str, start: float, end: float
) -> Span:
    """The request: GenAI semantic conventions (client view of one inference call) plus the ledger's."""
    arrived = next((e for e in events if e["kind"] == "arrived"), None)
    operation = _OPERATIONS.get(str(arrived.get("endpoint"))) if arrived else None
    operation = operation or "text_completion"
    model = row.get("model")
    attrs: Attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "vllm",
        "chunkledger.request_id": str(row["request_id"]),
    }
    if model:
        attrs["gen_ai.request.model"] = attrs["gen_ai.response.model"] = str(model)
    for key, col in (
        ("gen_ai.request.max_tokens", "max_tokens"),
        ("gen_ai.usage.input_tokens", "prompt_tokens"),
        ("gen_ai.usage.output_tokens", "output_tokens"),
        ("chunkledger.cached_tokens", "cached_tokens"),
        ("chunkledger.preemptions", "preemptions"),
        ("chunkledger.chunks", "chunks"),
        ("http.response.status_code", "status_code"),
    ):
        if isinstance(row.get(col), int):
            attrs[key] = int(row[col])
    if row.get("finish_reason"):
        attrs["gen_ai.response.finish_reasons"] = [str(row["finish_reason"])]
    # vLLM's own names for the same intervals (its llm_request span), and the ledger's layers.
    for key, col in (
        ("gen_ai.latency.time_to_first_token", "ttft_s"),
        ("gen_ai.latency.e2e", "e2e_s"),
        ("gen_ai.latency.time_in_queue", "engine_queue_s"),
        ("chunkledger.client_ttft_s", "client_ttft_s"),
        ("chunkledger.kv_idle_s", "kv_idle_s"),
    ):
        if isinstance(row.get(col), (int, float)):
            attrs[key] = float(row[col])
    model_name = f" {model}" if model else ""
    span = Span(
        f"{operation}{model_name}", span_id, row.get("parent_span_id"), start, end, attrs, server=True
    )
    span.events = _cutoff_events(row, events, start, end)
    status = row.get("status_code")
    if row.get("finish_reason") == "error" or (isinstance(status, int) and status >= 500):
        span.error = f"finish_reason {row.get('finish_reason')}, status {status}"
    return span


def _cutoff_events(
    row: dict[str, Any], events: list[dict[str, Any]], start: float, end: float
) -> list[SpanEvent]:
    """The cutoff, once: when the gateway cut the stream, else when a source applied the command."""
    rule = row.get("cut_rule")
    if not rule:
        return []
    cut = next((e for e in events if e["kind"] == "stream_cut"), None) or next(
        (e for e in events if e["kind"] == "cutoff_applied"), None
    )
    ts = cut["ts"] if cut is not None else end
    attrs: Attributes = {"chunkledger.rule": str(rule)}
    if cut is not None and cut.get("action"):
        attrs["chunkledger.action"] = str(cut["action"])
    if row.get("stop_reason"):
        attrs["chunkledger.stop_reason"] = str(row["stop_reason"])
    return [SpanEvent("cutoff", _clamp(ts, start, end), attrs)]


def _waits(row: dict[str, Any]) -> tuple[float, float]:
    """(preempted waits before the first token, after it): the view's ``w_pre`` and ``w_dec``."""
    scheduled = row.get("first_scheduled_ts") is not None
    token = row.get("first_token_ts") is not None or row.get("first_token_out_ts") is not None
    final = _num(row, "final_wait_s") if scheduled else 0.0
    return (
        _num(row, "requeue_wait_prefill_s") + (final if not token else 0.0),
        _num(row, "requeue_wait_decode_s") + (final if token else 0.0),
    )


def _layer_spans(row: dict[str, Any], rid: str, parent: str, start: float) -> list[Span]:
    w_pre, w_dec = _waits(row)
    durations = {
        "entry": _num(row, "entry_s"),
        "admission": _num(row, "admission_s"),
        "frontend": _num(row, "frontend_s"),
        "engine_queue": max(0.0, _num(row, "engine_queue_s") - w_pre - w_dec),
        "prefill": _num(row, "prefill_s") + w_pre,
        "decode": _num(row, "decode_s") + w_dec,
    }
    layer_s = {
        "engine_queue": _num(row, "engine_queue_s"),
        "prefill": _num(row, "prefill_s"),
        "decode": _num(row, "decode_s"),
    }
    gateway = row.get("gateway_source_id") is not None
    spans, t = [], start
    for name in LAYERS:
        d = durations[name]
        if name in ("entry", "admission") and not gateway:
            continue
        attrs: Attributes = {"chunkledger.layer": name, "chunkledger.layer_s": layer_s.get(name, d)}
        spans.append(Span(name, derived_id(rid, name, 8), parent, t, t + d, attrs))
        t += d
    return spans


def _idle_spans(rid: str, layers: list[Span], events: list[dict[str, Any]]) -> list[Span]:
    """A ``preempted`` span per wait after a preemption (``resumed``'s ``wait_s``, and a ``finished``
    that ended a request while it waited), under the prefill or the decode span it delayed."""
    by_name = {s.name: s for s in layers}
    prefill, decode = by_name.get("prefill"), by_name.get("decode")
    out: list[Span] = []
    for e in events:
        wait = e.get("wait_s")
        if e["kind"] not in ("resumed", "finished") or not isinstance(wait, (int, float)) or wait <= 0:
            continue
        if e["kind"] == "finished" and prefill is not None and e["ts"] <= prefill.start:
            continue  # never scheduled: its wait is the engine queue's
        in_decode = e["kind"] == "resumed" and (e.get("output_tokens") or 0) > 0
        layer = decode if in_decode or (prefill is None) else prefill
        if e["kind"] == "finished" and decode is not None and e["ts"] >= decode.start:
            layer = decode
        if layer is None:
            continue
        end = _clamp(float(e["ts"]), layer.start, layer.end)
        begin = _clamp(end - float(wait), layer.start, end)
        attrs: Attributes = {"chunkledger.wait_s": float(wait)}
        name = f"preempted.{len(out)}"
        out.append(Span("preempted", derived_id(rid, name, 8), layer.span_id, begin, end, attrs))
    return out


def _chunk_events(events: list[dict[str, Any]], prefill: Span) -> list[SpanEvent]:
    out = []
    for e in events:
        if e["kind"] != "chunk":
            continue
        attrs: Attributes = {
            "chunkledger.tokens": int(e.get("tokens") or 0),
            "chunkledger.depth_tokens": int(e.get("computed_before") or 0),
            "chunkledger.cached_tokens": int(e.get("cached_tokens") or 0),
            "chunkledger.recomputed_tokens": int(e.get("recomputed_tokens") or 0),
            "chunkledger.step": int(e.get("step") or 0),
        }
        out.append(SpanEvent("prefill_chunk", _clamp(float(e["ts"]), prefill.start, prefill.end), attrs))
    return out
