"""The ledger service: ``create_app(settings)``."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from ledger.api import advice as advice_api
from ledger.api import analytics, errors, events, health, openapi, requests
from ledger.api import commands as commands_api
from ledger.api import metrics as metrics_api
from ledger.api import policy as policy_api
from ledger.api import sql as sql_api
from ledger.api import webhooks as webhooks_api
from ledger.api import whatif as whatif_api
from ledger.api.gate import RequestGate
from ledger.config import Settings, get_settings
from ledger.ingest import IngestWriter
from ledger.jetstream.worker import StreamWorker
from ledger.metrics import LedgerMetrics
from ledger.producers import ProducerBook
from ledger.ratelimit import SourceLimits
from ledger.reads import Reads
from ledger.runaway import RunawayService
from ledger.sql.runners import open_runner as open_sql_runner
from ledger.store import Store, open_store
from ledger.watchdog import LoopWatchdog
from ledger.webhooks.targets import TargetPolicy

# Ingest allocates a few objects per event and makes almost no reference cycles; with CPython's default
# thresholds (a young collection every 700 allocations) the collector ran every few hundred events and
# re-walked the long-lived objects: measured here, it doubled the cost of decoding a batch.
GC_THRESHOLDS = (50_000, 20, 20)


def _tune_gc() -> None:
    """Collect the young generation less often, and move everything alive after start-up (modules,
    the store, the app) out of the collector's walks for good."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _observe_group(metrics: LedgerMetrics) -> Callable[[float, int], None]:
    def observe(seconds: float, events: int) -> None:
        metrics.ingest_group_seconds.observe(seconds)
        metrics.ingest_group_events.observe(events)

    return observe


def _observe_stall(metrics: LedgerMetrics) -> Callable[[float], None]:
    def observe(seconds: float) -> None:
        metrics.event_loop_stalls.inc()
        metrics.event_loop_stall_seconds.inc(seconds)

    return observe


def _open_services(app: FastAPI, settings: Settings, store: Store | None) -> None:
    """The store (opened and migrated unless given), reads, SQL, ingest's threads, the rules and
    webhooks service and the writer, on ``app.state``."""
    state = app.state
    state.store = store or open_store(settings.db_url, persist_token_ids=settings.persist_token_ids)
    state.reads = Reads(state.store, settings)  # before the SQL runner: DuckDB's limits
    state.producers = ProducerBook(state.store, lease_s=settings.producer_lease_s)
    state.sql = open_sql_runner(state.store, reader_url=settings.sql_reader_url, settings=settings)
    # Ingest's own threads (what its answer writes besides the batch: command deliveries), so no
    # read load can queue it behind the shared worker threads.
    state.ingest_pool = ThreadPoolExecutor(4, thread_name_prefix="chunkledger-ingest")
    state.runaway = RunawayService(
        None if state.store.dialect == "null" else state.store.engine,
        state.metrics,
        policy_file=settings.policy_file or None,
        webhook_options={
            "max_attempts": settings.webhook_max_attempts,
            "base_backoff_s": settings.webhook_backoff_s,
            "max_backoff_s": settings.webhook_backoff_max_s,
            "timeout_s": settings.webhook_timeout_s,
            "targets": TargetPolicy.parse(settings.webhook_allow),
        },
    )
    state.traces = _trace_export(state, settings)
    state.runaway.traces = state.traces
    state.runaway.start()
    state.writer = IngestWriter(
        state.store,
        max_group_events=settings.group_commit_max_events,
        on_commit=state.runaway.on_commit,
        on_group=_observe_group(state.metrics),
    )
    state.writer.start()


def _trace_export(state: Any, settings: Settings) -> Any:
    """The OTLP export of finished requests when an endpoint is configured (``ledger.traces``), else
    None. It needs the ``otlp`` extra (OpenTelemetry's SDK and protobuf definitions)."""
    from ledger.traces.enabled import export_enabled

    if state.store.dialect == "null" or not export_enabled(settings.otlp_traces_endpoint):
        return None
    try:
        from ledger.traces.export import TraceExport, TraceExportOptions
    except ImportError as exc:
        raise RuntimeError(
            f"an OTLP traces endpoint is configured but OpenTelemetry is not installed ({exc}); "
            "install chunkledger[otlp]"
        ) from exc
    options = TraceExportOptions(
        settings.otlp_traces_endpoint,
        max_queue_spans=settings.traces_max_queue_spans,
        batch_spans=settings.traces_batch_spans,
        delay_s=settings.traces_delay_s,
    )
    export = TraceExport(state.store.engine, state.metrics, options)
    export.start()
    return export


def _close_services(app: FastAPI, *, close_store: bool) -> None:
    """Stop what ``_open_services`` started, the writer first (it drains into the store)."""
    state = app.state
    state.writer.stop()
    state.runaway.stop()
    if state.traces is not None:
        state.traces.shutdown(timeout=5.0)
    state.sql.close()
    state.reads.close()
    state.ingest_pool.shutdown(wait=False)
    if close_store:
        state.store.close()


def create_app(
    settings: Settings | None = None, *, store: Store | None = None, tune_gc: bool = False
) -> FastAPI:
    """Build the app. The store is opened (and migrated) at startup unless one is passed in.

    ``tune_gc``: for the service process (``chunkledger serve``), not for an app among others.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        _open_services(app, settings, store)
        watchdog = LoopWatchdog(on_stall=_observe_stall(app.state.metrics))
        watchdog.start()
        worker = app.state.stream_worker = StreamWorker(settings, app.state) if settings.nats_url else None
        try:
            if worker is not None:
                await worker.start()
            if tune_gc:
                _tune_gc()
            yield
        finally:
            if worker is not None:
                await worker.stop()  # its consumers' commits done before the writer stops
            await watchdog.stop()
            _close_services(app, close_store=store is None)

    app = FastAPI(title="chunkledger", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.source_limits = SourceLimits(
        events_per_s=settings.ingest_source_events_per_s,
        bytes_per_s=settings.ingest_source_bytes_per_s,
        burst_s=settings.ingest_source_burst_s,
    )
    app.state.metrics = LedgerMetrics(
        max_models=settings.metrics_max_models,
        max_sources=settings.metrics_max_sources,
        max_reasons=settings.metrics_max_reasons,
        max_label_length=settings.metrics_max_label_length,
    )
    routers = [
        health.router,
        events.router,
        requests.router,
        policy_api.router,
        commands_api.router,
        webhooks_api.router,
        metrics_api.router,
        analytics.router,
        advice_api.router,
        whatif_api.router,
        sql_api.router,
    ]
    # auth, origin, content type, read slots, body and send limits, before the app reads anything
    app.add_middleware(RequestGate, settings=settings, metrics=app.state.metrics, routers=routers)
    errors.install(app)  # one error body on every route: {"reason", "detail", "errors"?}
    for router in routers:
        app.include_router(router)
    openapi.install(app)
    return app
