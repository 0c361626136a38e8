"""The machine's NATS JetStream (127.0.0.1:4222, CI's too) and PostgreSQL: a stream and a database of
their own per test, and ledger workers started as ``chunkledger serve`` with ``nats_url``."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from ledger.store import open_store
from tests.conftest import PG_ADMIN_URL
from tests.support.servers import LedgerServer

NATS_URL = os.environ.get("CHUNKLEDGER_TEST_NATS", "nats://127.0.0.1:4222")


def _reachable(url: str) -> bool:
    host, port = url.removeprefix("nats://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


async def _drop_stream(url: str, name: str) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream(name)
    except Exception:
        pass
    finally:
        await nc.close()


@pytest.fixture
def nats_url() -> str:
    if not _reachable(NATS_URL):
        if os.environ.get("CI"):
            pytest.fail(f"NATS is not reachable at {NATS_URL}; CI runs the stream workers' tests on it")
        pytest.skip("NATS not reachable")
    return NATS_URL


@pytest.fixture
def stream(nats_url: str) -> Iterator[str]:
    """A stream name of the test's own (the first worker creates it); deleted afterwards."""
    name = f"CLT{uuid.uuid4().hex[:10].upper()}"
    yield name
    asyncio.run(_drop_stream(nats_url, name))


@pytest.fixture
def pg_url(pg_database: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database the test's workers share."""
    name = f"chunkledger_js_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    open_store(url).close()
    yield url
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


WorkerFactory = Callable[..., LedgerServer]


@pytest.fixture
def workers(nats_url: str, stream: str, pg_url: str, tmp_path: Path) -> Iterator[WorkerFactory]:
    """``start(partitions=8, **env)``: one more worker of the test's stream, started and serving."""
    started: list[LedgerServer] = []

    def start(partitions: int = 8, **env: str) -> LedgerServer:
        server = LedgerServer(
            pg_url,
            tmp_path / f"worker{len(started)}.log",
            env={
                "CHUNKLEDGER_NATS_URL": nats_url,
                "CHUNKLEDGER_NATS_STREAM": stream,
                "CHUNKLEDGER_NATS_PARTITIONS": str(partitions),
                "CHUNKLEDGER_NATS_BALANCE_S": "0.2",
                "CHUNKLEDGER_NATS_ACK_WAIT_S": "5",
                **env,
            },
        )
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(kill=True)
