"""The ledger service: ``create_app(settings)``."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ledger.api import advice as advice_api
from ledger.api import analytics, errors, events, health, openapi, requests
from ledger.api import commands as commands_api
from ledger.api import metrics as metrics_api
from ledger.api import policy as policy_api
from ledger.api import sql as sql_api
from ledger.api import webhooks as webhooks_api
from ledger.api import whatif as whatif_api
from ledger.api.body_timeout import BodyTimeoutMiddleware
from ledger.config import Settings, get_settings
from ledger.ingest import IngestWriter
from ledger.metrics import LedgerMetrics
from ledger.rules.service import RunawayService
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


def create_app(
    settings: Settings | None = None, *, store: Store | None = None, tune_gc: bool = False
) -> FastAPI:
    """Build the app. The store is opened (and migrated) at startup unless one is passed in.

    ``tune_gc``: for the service process (``chunkledger serve``), not for an app among others.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own_store = store is None
        app.state.store = store or open_store(settings.db_url, persist_token_ids=settings.persist_token_ids)
        app.state.sql = open_sql_runner(app.state.store, reader_url=settings.sql_reader_url)
        app.state.runaway = RunawayService(
            None if app.state.store.dialect == "null" else app.state.store.engine,
            app.state.metrics,
            policy_file=settings.policy_file or None,
            webhook_options={
                "max_attempts": settings.webhook_max_attempts,
                "base_backoff_s": settings.webhook_backoff_s,
                "max_backoff_s": settings.webhook_backoff_max_s,
                "timeout_s": settings.webhook_timeout_s,
                "targets": TargetPolicy.parse(settings.webhook_allow),
            },
        )
        app.state.runaway.start()
        app.state.writer = IngestWriter(
            app.state.store,
            max_group_events=settings.group_commit_max_events,
            on_commit=app.state.runaway.on_commit,
            on_group=_observe_group(app.state.metrics),
        )
        app.state.writer.start()
        watchdog = LoopWatchdog(on_stall=_observe_stall(app.state.metrics))
        watchdog.start()
        if tune_gc:
            _tune_gc()
        try:
            yield
        finally:
            await watchdog.stop()
            app.state.writer.stop()
            app.state.runaway.stop()
            app.state.sql.close()
            if own_store:
                app.state.store.close()

    app = FastAPI(title="chunkledger", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = LedgerMetrics()
    app.add_middleware(BodyTimeoutMiddleware, timeout_s=settings.body_timeout_s)
    errors.install(app)  # one error body on every route: {"reason", "detail", "errors"?}
    app.include_router(health.router)
    app.include_router(events.router)
    app.include_router(requests.router)
    app.include_router(policy_api.router)
    app.include_router(commands_api.router)
    app.include_router(webhooks_api.router)
    app.include_router(metrics_api.router)
    app.include_router(analytics.router)
    app.include_router(advice_api.router)
    app.include_router(whatif_api.router)
    app.include_router(sql_api.router)
    openapi.install(app)
    return app
