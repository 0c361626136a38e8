"""A request's spans from its row and events (pure): which spans, their parents, and that they tile."""

from __future__ import annotations

from ledger.traces.spans import derived_id, request_trace

T0 = 1_700_000_000.0
TRACE, CALLER = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _engine_only_row(**extra):
    """A request without a gateway: frontend 0.01, queue 0.09 + a 0.2 s wait in decode, prefill 0.1,
    decode 0.5 (of a 0.7 s window): e2e 0.9."""
    row = {
        "request_id": "e1",
        "model": "tiny",
        "start_ts": T0,
        "e2e_s": 0.9,
        "entry_s": 0.0,
        "admission_s": 0.0,
        "frontend_s": 0.01,
        "engine_queue_s": 0.29,
        "prefill_s": 0.1,
        "decode_s": 0.5,
        "first_scheduled_ts": T0 + 0.1,
        "first_token_ts": T0 + 0.2,
        "requeue_wait_prefill_s": 0.0,
        "requeue_wait_decode_s": 0.2,
        "final_wait_s": 0.0,
        "gateway_source_id": None,
        "trace_id": TRACE,
        "parent_span_id": CALLER,
        "span_id": None,
        "finish_reason": "error",
        "prompt_tokens": 12,
        "output_tokens": 5,
    }
    row.update(extra)
    return row


def test_without_a_gateway_the_request_span_is_a_child_of_the_caller_and_has_no_gateway_layers():
    resumed = {"kind": "resumed", "ts": T0 + 0.6, "wait_s": 0.2, "output_tokens": 3}
    trace = request_trace(_engine_only_row(), [resumed])
    assert trace is not None and trace.trace_id == TRACE
    request, *children = trace.spans
    assert request.span_id == derived_id("e1", "request", 8) and request.parent_span_id == CALLER
    assert request.name == "text_completion tiny" and request.error is not None  # finish_reason error
    layers = [s for s in children if s.parent_span_id == request.span_id]
    assert [s.name for s in layers] == ["frontend", "engine_queue", "prefill", "decode"]
    assert [round(s.end - s.start, 6) for s in layers] == [0.01, 0.09, 0.1, 0.7]  # doubles near 1.7e9
    assert layers[0].start == request.start and abs(layers[-1].end - request.end) < 1e-6
    (idle,) = [s for s in children if s.name == "preempted"]
    decode = layers[-1]
    assert idle.parent_span_id == decode.span_id
    assert abs((idle.end - idle.start) - 0.2) < 1e-6 and decode.start <= idle.start and idle.end <= decode.end


def test_ids_are_stable_and_an_untraced_request_gets_a_trace_of_its_own():
    row = _engine_only_row(trace_id=None, parent_span_id=None)
    first, again = request_trace(row, []), request_trace(row, [])
    assert first is not None and again is not None
    assert first.trace_id == again.trace_id == derived_id("e1", "trace", 16)
    assert [s.span_id for s in first.spans] == [s.span_id for s in again.spans]
    assert first.spans[0].parent_span_id is None
    assert len({s.span_id for s in first.spans}) == len(first.spans)


def test_a_request_not_complete_has_no_trace_yet():
    assert request_trace(_engine_only_row(e2e_s=None), []) is None
