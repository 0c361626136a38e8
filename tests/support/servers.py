"""Processes the tests start and stop: a real ``chunkledger serve`` on a free port, and helpers to wait
for a server and to stop a process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import sqlalchemy as sa

from bench.toolkit import free_port


class LedgerServer:
    """``chunkledger serve`` in a subprocess, on a free port, that tests can kill and restart."""

    def __init__(self, db_url: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.db_url = db_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the subprocess
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chunkledger", "serve", "--db", self.db_url, "--port", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ledger exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}"
                )
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"ledger not ready in {timeout}s: {self.log_path.read_text()[-2000:]}")

    def stop(self, kill: bool = False, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            self.proc.wait(timeout)
        self.proc = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def wait_serving(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 60.0) -> None:
    """Until ``url`` answers 200; RuntimeError when ``proc`` exits first, TimeoutError (after stopping
    it) when the time runs out. ``proc`` runs in a session of its own (``start_new_session``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_group(proc)
    raise TimeoutError(f"{url} did not answer 200 in {timeout} s: {log.read_text()[-3000:]}")


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM to the process group of ``proc`` (started with ``start_new_session``), SIGKILL after
    ``timeout``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@contextlib.contextmanager
def served_ledger(
    backend: str, pg_base: str | None, tmp: Path, env: dict[str, str] | None = None
) -> Iterator[LedgerServer]:
    """A real ``chunkledger serve`` on a database of its own (a DuckDB file in ``tmp``, or a new
    PostgreSQL database next to ``pg_base``, dropped afterwards), for a module's tests to share."""
    name = None
    if backend == "duckdb":
        url = f"duckdb:///{tmp / 'ledger.duckdb'}"
    else:
        assert pg_base is not None
        name = f"chunkledger_srv_{uuid.uuid4().hex[:10]}"
        admin = sa.create_engine(pg_base, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        url = pg_base.rsplit("/", 1)[0] + f"/{name}"
    server = LedgerServer(url, tmp / "ledger.log", env=env)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        if name is not None:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            admin.dispose()
