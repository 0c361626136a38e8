"""W3C Trace Context parsing: what a valid traceparent is, and what is ignored (a new trace then)."""

from __future__ import annotations

import pytest

from engine_hooks.tracecontext import (
    TraceParent,
    format_traceparent,
    new_span_id,
    new_trace_id,
    parse_traceparent,
    valid_tracestate,
)

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_the_standards_example_parses_and_formats_back():
    header = f"00-{TRACE}-{SPAN}-01"
    assert parse_traceparent(header) == TraceParent(TRACE, SPAN, 1)
    assert parse_traceparent(header.encode()) == TraceParent(TRACE, SPAN, 1)
    assert format_traceparent(TRACE, SPAN, 1) == header
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-00").flags == 0


def test_a_later_version_may_append_fields():
    assert parse_traceparent(f"01-{TRACE}-{SPAN}-01-extra") == TraceParent(TRACE, SPAN, 1)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        f"00-{TRACE.upper()}-{SPAN}-01",  # upper case
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero span
        f"ff-{TRACE}-{SPAN}-01",  # forbidden version
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE[:-1]}-{SPAN}-01",  # short trace id
        f"00-{TRACE}-{SPAN}",  # no flags
    ],
)
def test_invalid_headers_are_ignored(header):
    assert parse_traceparent(header) is None


def test_tracestate_passes_when_printable_ascii_of_at_most_512():
    assert (
        valid_tracestate(b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
        == "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"
    )
    assert valid_tracestate("a=" + "b" * 510) is not None
    assert valid_tracestate("a=" + "b" * 511) is None
    assert valid_tracestate("a=\x00") is None
    assert valid_tracestate("") is None


def test_new_ids_are_valid_and_differ():
    trace, span = new_trace_id(), new_span_id()
    assert parse_traceparent(format_traceparent(trace, span)) == TraceParent(trace, span, 1)
    assert new_trace_id() != trace and new_span_id() != span
