"""Shared fixtures: both storage backends (DuckDB file, real local PostgreSQL) and a real server."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.servers import LedgerServer

PG_ADMIN_URL = os.environ.get("CHUNKLEDGER_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
BACKENDS = ["duckdb", "postgres"]


def _pg_available() -> bool:
    try:
        eng = sa.create_engine(PG_ADMIN_URL)
        with eng.connect():
            pass
        eng.dispose()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A throwaway PostgreSQL database for this test run, dropped afterwards."""
    if not _pg_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}; CI runs every storage test on it")
        pytest.skip("PostgreSQL not reachable")
    name = f"chunkledger_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    yield url
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


_PG_MIGRATED: set[str] = set()


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty ledger database on each backend."""
    if request.param == "duckdb":
        yield f"duckdb:///{tmp_path / 'ledger.duckdb'}"
        return
    url = request.getfixturevalue("pg_database")
    eng = sa.create_engine(url)
    with eng.begin() as conn:
        tables = conn.exec_driver_sql(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' AND tablename <> 'alembic_version'"
        ).all()
        if tables:
            conn.exec_driver_sql("TRUNCATE " + ", ".join(t[0] for t in tables))
    eng.dispose()
    yield url


@pytest.fixture
def store(db_url: str) -> Iterator[object]:
    from ledger.store import open_store

    s = open_store(db_url)
    yield s
    s.close()


@pytest.fixture
def ledger_server(tmp_path: Path) -> Iterator[LedgerServer]:
    """A real ledger on a DuckDB file. After ``stop()`` the file can be opened with duckdb directly."""
    server = LedgerServer(f"duckdb:///{tmp_path / 'ledger.duckdb'}", tmp_path / "ledger.log")
    server.start()
    yield server
    server.stop()
