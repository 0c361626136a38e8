"""Alembic environment. Run through ``chunkledger migrate`` (or ``ledger.migrate.upgrade``)."""

from __future__ import annotations

from alembic import context
from alembic.ddl.postgresql import PostgresqlImpl
from sqlalchemy import create_engine, pool

from ledger.schema import metadata


class DuckDBImpl(PostgresqlImpl):
    """Alembic has no DuckDB dialect; DuckDB speaks PostgreSQL's DDL closely enough."""

    __dialect__ = "duckdb"
    transactional_ddl = True


def run_migrations() -> None:
    config = context.config
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.get_main_option("sqlalchemy.url")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `chunkledger migrate --db URL`")
run_migrations()
