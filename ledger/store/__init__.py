"""Storage backends behind one interface: ``open_store(url)`` migrates and returns a Store."""

from __future__ import annotations

import sqlalchemy as sa

from ledger import migrate
from ledger.store.base import Store, WriteResult


class MissingDriver(RuntimeError):
    """The database URL names a driver this install lacks; the message says which extra brings it."""


def check_driver(url: str) -> None:
    """Raise :class:`MissingDriver` if the URL's database driver is not installed."""
    if url.startswith("null://"):
        return
    parsed = sa.engine.make_url(url)
    try:
        parsed.get_dialect().import_dbapi()
    except ImportError as exc:
        if exc.name == "psycopg":
            how = "pip install 'chunkledger[postgres]'"
        elif parsed.get_backend_name() == "postgresql":
            how = "use a postgresql+psycopg:// URL and pip install 'chunkledger[postgres]'"
        else:
            how = f"install {exc.name}"
        raise MissingDriver(
            f"{parsed.drivername} needs the Python package {exc.name!r}, which is not installed: {how}"
        ) from None


def make_engine(url: str) -> sa.Engine:
    check_driver(url)
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


__all__ = ["MissingDriver", "Store", "WriteResult", "check_driver", "make_engine", "open_store"]
