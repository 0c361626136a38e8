"""OTLP/HTTP (protobuf) export of finished requests, beside ingest and never in its way.

The shape of OpenTelemetry's batch processor (the messages and the POST: ``ledger.traces.otlp``):

* ``offer(rows)`` (the rules ticker, with the ``requests`` rows of the requests it observed finished,
  read once for the metrics and for this) appends to a bounded deque and returns: it never blocks,
  never raises, and what does not fit is dropped and counted.
* A builder thread wakes every ``delay_s``, reads the due requests' events (one query for all of
  them, on the ledger's read engine) and turns each into spans (``ledger.traces.spans``), into a
  bounded span queue; spans that do not fit are dropped, counted (``queue_full``).
* A sender thread sends batches of up to ``batch_spans`` spans as soon as the builder has added to the
  queue. A batch the sender gave up on (endpoint down past its timeout, a 4xx) is dropped and counted
  (``export_failed``): memory stays bounded by the two queues whatever the endpoint does, and ingest
  never waits for it.
* ``shutdown()`` builds what is due, sends what is queued (within a timeout), and stops; idempotent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import sqlalchemy as sa
from opentelemetry.sdk.resources import Resource

from ledger.traces.otlp import OtlpHttpSender, SenderConfig, encode
from ledger.traces.spans import EVENT_KINDS, RequestTrace, Span, request_trace

log = logging.getLogger(__name__)

_CLOCK_SLACK_S = 300.0  # how far one source's clock may be behind another's (max_clock_ahead_s's default)


class SpanSender(Protocol):
    """What sends an encoded batch (``OtlpHttpSender``): True when the endpoint took it."""

    def send(self, body: bytes) -> bool: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class TraceExportOptions:
    endpoint: str  # full URL of the OTLP/HTTP traces endpoint ("": the OTEL_EXPORTER_OTLP_* variables)
    max_queue_spans: int = 65_536
    max_queue_requests: int = 4096  # rows of about 5 KB each
    batch_spans: int = 512
    delay_s: float = 1.0


class Counters(Protocol):
    """The metrics the export reports to (``LedgerMetrics`` has them)."""

    def trace_spans_exported(self, n: int) -> None: ...
    def trace_spans_dropped(self, reason: str, n: int) -> None: ...
    def trace_export_attempt(self, ok: bool) -> None: ...


class TraceExport:
    def __init__(
        self,
        engine: sa.Engine,
        counters: Counters,
        options: TraceExportOptions,
        *,
        sender: SpanSender | None = None,
        resource: Resource | None = None,
    ) -> None:
        self.engine = engine
        self.counters = counters
        self.options = options
        self.sender: SpanSender = sender or OtlpHttpSender(SenderConfig.resolve(options.endpoint))
        # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES.
        self.resource = resource or Resource.create({"service.name": "chunkledger"})
        self._rows: deque[Mapping[str, Any]] = deque()
        self._spans: deque[tuple[str, Span]] = deque()  # (trace id, span)
        self._lock = threading.Lock()
        self._wake_builder = threading.Event()
        self._wake_sender = threading.Event()
        self._stop = threading.Event()
        self._sending = 0  # spans taken by the sender and not yet settled
        self._threads: list[threading.Thread] = []
        self._stopped = False

    # -- host API -------------------------------------------------------------------------------------
    def start(self) -> None:
        for name, target in (
            ("chunkledger-traces-build", self._build_loop),
            ("chunkledger-traces-send", self._send_loop),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def offer(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Queue finished requests (their ``requests`` rows) for export; never blocks: a full queue drops
        and counts them."""
        try:
            with self._lock:
                room = self.options.max_queue_requests - len(self._rows)
                self._rows.extend(rows[: max(0, room)])
            if len(rows) > room:
                self.counters.trace_spans_dropped("request_queue_full", len(rows) - max(0, room))
        except Exception:
            log.exception("trace export: could not queue finished requests")

    @property
    def queued(self) -> tuple[int, int]:
        """(requests waiting to be built, spans waiting to be sent)."""
        return len(self._rows), len(self._spans)

    def flush(self, timeout: float = 10.0) -> bool:
        """Build what is queued and wait until every span is settled (sent or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        self._wake_builder.set()
        while time.monotonic() < deadline:
            if not self._rows and not self._spans and not self._sending and not self._wake_builder.is_set():
                return True
            self._wake_sender.set()
            time.sleep(0.01)
        return False

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.flush(timeout)
        self._stop.set()
        self._wake_builder.set()
        self._wake_sender.set()
        for t in self._threads:
            t.join(timeout)
        try:
            self.sender.close()
        except Exception:
            log.exception("trace export: closing the OTLP sender failed")

    # -- builder --------------------------------------------------------------------------------------
    def _build_loop(self) -> None:
        while not self._stop.is_set():
            self._wake_builder.wait(self.options.delay_s)
            try:
                while self._rows:
                    self._build_once()
            except Exception:
                log.exception("trace export: building spans failed")
            finally:
                self._wake_builder.clear()

    def _build_once(self, limit: int = 1000) -> None:
        with self._lock:
            rows = [self._rows.popleft() for _ in range(min(limit, len(self._rows)))]
        if not rows:
            return
        try:
            traces = self._read(rows)
        except Exception:
            log.exception("trace export: reading the events of %d finished requests failed", len(rows))
            self.counters.trace_spans_dropped("read_failed", len(rows))
            return
        spans = [(t.trace_id, s) for t in traces for s in t.spans]
        with self._lock:
            room = self.options.max_queue_spans - len(self._spans)
            self._spans.extend(spans[: max(0, room)])
        if len(spans) > room:
            self.counters.trace_spans_dropped("queue_full", len(spans) - max(0, room))
        self._wake_sender.set()

    def _read(self, rows: list[Mapping[str, Any]]) -> list[RequestTrace]:
        # ts bounds the scan: DuckDB prunes the events table's row groups by it (it has no index on
        # request_id); an engine's stamps may run behind the gateway's start by up to _CLOCK_SLACK_S.
        events_sql = sa.text(
            "SELECT request_id, kind, ts, data FROM events "
            "WHERE request_id IN :ids AND kind IN :kinds AND ts >= :since"
        ).bindparams(sa.bindparam("ids", expanding=True), sa.bindparam("kinds", expanding=True))
        starts = [r["start_ts"] for r in rows if isinstance(r.get("start_ts"), (int, float))]
        if not starts:
            return []
        ids = [str(r["request_id"]) for r in rows]
        since = min(starts) - _CLOCK_SLACK_S
        with self.engine.connect() as conn:
            found = conn.execute(events_sql, {"ids": ids, "kinds": list(EVENT_KINDS), "since": since}).all()
        events: dict[str, list[dict[str, Any]]] = {}
        for request_id, kind, ts, data in found:
            fields = msgspec.json.decode(data) if data else {}
            fields.update(kind=kind, ts=ts)
            events.setdefault(request_id, []).append(fields)
        out = []
        for row in rows:
            built = request_trace(dict(row), events.get(str(row["request_id"]), []))
            if built is not None:
                out.append(built)
        return out

    # -- sender ---------------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            self._wake_sender.wait(self.options.delay_s)
            self._wake_sender.clear()
            while self._spans:
                self._send_batch()
            if self._stop.is_set() and not self._spans:
                return

    def _send_batch(self) -> None:
        with self._lock:
            self._sending = n = min(self.options.batch_spans, len(self._spans))  # before the queue shrinks
            batch = [self._spans.popleft() for _ in range(n)]
        try:
            try:
                ok = self.sender.send(encode(batch, self.resource))
            except Exception:
                log.exception("trace export: encoding or sending a batch failed")
                ok = False
            self.counters.trace_export_attempt(ok)
            if ok:
                self.counters.trace_spans_exported(len(batch))
            else:
                self.counters.trace_spans_dropped("export_failed", len(batch))
        finally:
            self._sending = 0
