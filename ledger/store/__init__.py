"""Storage backends behind one interface: ``open_store(url)`` migrates and returns a Store."""

from __future__ import annotations

import sqlalchemy as sa

from ledger import migrate
from ledger.store.base import Store, WriteResult


def make_engine(url: str) -> sa.Engine:
    if url.startswith("duckdb"):
        return sa.create_engine(url)
    return sa.create_engine(url, pool_size=8, max_overflow=8, pool_pre_ping=True)


def open_store(url: str, *, persist_token_ids: bool = False, run_migrations: bool = True) -> Store:
    """Open the ledger database at ``url``; upgrade its schema first unless told not to."""
    if url.startswith("null://"):
        from ledger.store.null import NullStore

        return NullStore()
    engine = make_engine(url)
    if run_migrations:
        migrate.upgrade(engine)
    if engine.dialect.name == "duckdb":
        from ledger.store.duckdb import DuckDBStore

        return DuckDBStore(engine, persist_token_ids=persist_token_ids)
    if engine.dialect.name == "postgresql":
        from ledger.store.postgres import PostgresStore

        return PostgresStore(engine, persist_token_ids=persist_token_ids)
    raise ValueError(f"unsupported database: {engine.dialect.name}")


__all__ = ["Store", "WriteResult", "make_engine", "open_store"]
