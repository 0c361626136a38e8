"""A real OTLP/HTTP traces receiver for tests: ``POST /v1/traces`` with an ``ExportTraceServiceRequest``
in protobuf (gzip or not), decoded with the official definitions (opentelemetry-proto), every span kept.

``status`` answers every export with that HTTP status (503: the exporter retries; 200: accepted), after
the statuses queued in ``first`` (one per export, with ``retry_after`` as its Retry-After when set)."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    status_code: int
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    def __init__(
        self, status: int = 200, first: list[int] | None = None, retry_after: str | None = None
    ) -> None:
        self.status = status
        self.first = list(first or [])
        self.retry_after = retry_after
        self.headers: list[dict[str, str]] = []
        self.times: list[float] = []
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self.content_types: set[str] = set()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                encoding = (self.headers.get("content-encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                status = receiver.first.pop(0) if receiver.first else receiver.status
                receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                receiver.times.append(time.monotonic())
                receiver._receive(self.path, self.headers.get("content-type") or "", body, status)
                answer = ExportTraceServiceResponse().SerializeToString() if status == 200 else b""
                self.send_response(status)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                if status != 200 and receiver.retry_after is not None:
                    self.send_header("retry-after", receiver.retry_after)
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _receive(self, path: str, content_type: str, body: bytes, status: int) -> None:
        assert path == "/v1/traces", path
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self._lock:
            self.requests += 1
            self.content_types.add(content_type)
            if status != 200:
                return
            for rs in request.resource_spans:
                resource = _attrs(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            ReceivedSpan(
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(),
                                start_ns=s.start_time_unix_nano,
                                end_ns=s.end_time_unix_nano,
                                kind=s.kind,
                                attributes=_attrs(s.attributes),
                                events=[(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                                status_code=s.status.code,
                                resource=resource,
                                scope=ss.scope.name,
                            )
                        )

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
