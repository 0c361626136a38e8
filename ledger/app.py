"""The ledger service: ``create_app(settings)``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ledger.api import advice as advice_api
from ledger.api import analytics, events, health, requests
from ledger.api import sql as sql_api
from ledger.config import Settings, get_settings
from ledger.ingest import IngestWriter
from ledger.sql import open_runner as open_sql_runner
from ledger.store import Store, open_store


def create_app(settings: Settings | None = None, *, store: Store | None = None) -> FastAPI:
    """Build the app. The store is opened (and migrated) at startup unless one is passed in."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own_store = store is None
        app.state.store = store or open_store(settings.db_url, persist_token_ids=settings.persist_token_ids)
        app.state.sql = open_sql_runner(app.state.store, reader_url=settings.sql_reader_url)
        app.state.writer = IngestWriter(app.state.store, max_group_events=settings.group_commit_max_events)
        app.state.writer.start()
        try:
            yield
        finally:
            app.state.writer.stop()
            app.state.sql.close()
            if own_store:
                app.state.store.close()

    app = FastAPI(title="chunkledger", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.include_router(health.router)
    app.include_router(events.router)
    app.include_router(requests.router)
    app.include_router(analytics.router)
    app.include_router(advice_api.router)
    app.include_router(sql_api.router)
    return app
