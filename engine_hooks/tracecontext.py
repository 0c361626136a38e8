"""W3C Trace Context (https://www.w3.org/TR/trace-context/): the ``traceparent`` and ``tracestate``
headers, read and written by the gateway and read from vLLM's request by the engine plugin.

``traceparent`` is ``<version>-<trace id: 32 hex>-<parent span id: 16 hex>-<flags: 2 hex>``, lower
case; an all-zero trace or span id is invalid, and so is version ``ff``. A later version may append
fields after the flags, which a reader of version 00 ignores. As the standard asks, a header that does
not parse is ignored (the gateway starts a trace of its own) rather than refused, and ``tracestate``
travels only with a valid ``traceparent``, at most 512 characters of it. Pure functions of strings:
no dependency, cheap enough for every request.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
TRACESTATE_MAX = 512  # the standard's limit a vendor must propagate; longer values are dropped
SAMPLED = 0x01

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


class TraceParent(NamedTuple):
    """A parsed ``traceparent``: the trace, the caller's span (the parent of what we start) and flags."""

    trace_id: str  # 32 lowercase hex digits
    span_id: str  # 16 lowercase hex digits: the span that sent the request
    flags: int  # bit 0: sampled


def parse_traceparent(value: str | bytes | None) -> TraceParent | None:
    """The header's trace, or None when it is absent or invalid (a new trace is started then)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return TraceParent(trace_id, span_id, int(flags, 16))


def format_traceparent(trace_id: str, span_id: str, flags: int = SAMPLED) -> str:
    return f"00-{trace_id}-{span_id}-{flags:02x}"


def valid_tracestate(value: str | bytes | None) -> str | None:
    """``tracestate`` to pass on: as received, when printable ASCII of at most 512 characters."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    value = value.strip()
    if not value or len(value) > TRACESTATE_MAX or not value.isascii() or not value.isprintable():
        return None
    return value


def new_trace_id() -> str:
    return os.urandom(16).hex()


def new_span_id() -> str:
    return os.urandom(8).hex()
