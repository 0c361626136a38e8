"""Whether the ledger exports spans: importable without OpenTelemetry installed."""

from __future__ import annotations

import os
from collections.abc import Mapping

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def export_enabled(endpoint: str, environ: Mapping[str, str] | None = None) -> bool:
    """Export is on when an endpoint is configured here or in the standard variables (and
    ``OTEL_TRACES_EXPORTER`` is not ``none``). Refuses a protocol other than http/protobuf."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none" and not endpoint:
        return False
    on = bool(endpoint) or any(env.get(v, "").strip() for v in _ENDPOINT_VARS)
    for var in _PROTOCOL_VARS:
        protocol = env.get(var, "").strip()
        if on and protocol and protocol != "http/protobuf":
            raise ValueError(f"{var}={protocol!r}: the ledger exports OTLP over http/protobuf only")
        if protocol:
            break
    return on
