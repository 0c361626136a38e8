"""The real service in a subprocess: durability across kill -9, the CLI's safety checks."""

from __future__ import annotations

import json
import subprocess
import sys

import duckdb
import httpx
import pytest
import sqlalchemy as sa

from engine_hooks import columnar
from engine_hooks import events as ev
from ledger.migrate import head_revision
from tests.support.factories import ENGINE, body, numbered
from tests.support.factories import lifecycle as factories_lifecycle
from tests.support.servers import LedgerServer


def _encoded(evs: list, wire: str) -> tuple[bytes, dict[str, str]]:
    if wire == "json":
        return body(ENGINE, evs), {"content-type": "application/json"}
    return columnar.encode_batch(ev.Batch(source=ENGINE, events=evs)), {"content-type": columnar.MEDIA_TYPE}


@pytest.mark.parametrize("wire", ["json", "columns"])
def test_kill_9_right_after_a_200_loses_none_of_that_batch(db_url, tmp_path, wire):
    """On both backends and both wires: SIGKILL immediately after the last acknowledgement, then count
    the store."""
    server = LedgerServer(db_url, tmp_path / "ledger.log")
    server.start()
    total = 0
    try:
        with httpx.Client(base_url=server.url) as http:
            for b in range(5):
                evs = numbered(
                    [
                        ev.Tokens(seq=0, ts=10.0 + i, request_id=f"r{i % 50}", count=1, total=i + 1)
                        for i in range(2000)
                    ],
                    start=1 + b * 2000,
                )
                content, headers = _encoded(evs, wire)
                r = http.post("/v1/events", content=content, headers=headers)
                assert r.status_code == 200 and r.json()["accepted"] == 2000
                total += 2000
        server.stop(kill=True)
        engine = sa.create_engine(db_url)
        with engine.connect() as conn:
            counts = conn.exec_driver_sql("SELECT count(*), count(DISTINCT seq), max(seq) FROM events").one()
            assert tuple(counts) == (total, total, total)
            assert conn.exec_driver_sql("SELECT last_seq FROM sources").scalar_one() == total
            assert conn.exec_driver_sql("SELECT sum(token_events) FROM requests").scalar_one() == total
        engine.dispose()
        server.start()  # it comes back with the same high-water mark: a replay is all duplicates
        content, headers = _encoded(evs, wire)
        r = httpx.post(f"{server.url}/v1/events", content=content, headers=headers)
        assert r.json() == {"accepted": 0, "duplicates": 2000, "commands": []}
    finally:
        server.stop()


def test_serve_refuses_a_public_bind_without_tokens(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "chunkledger",
            "serve",
            "--db",
            f"duckdb:///{tmp_path}/x.duckdb",
            "--host",
            "0.0.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2
    assert "CHUNKLEDGER_INGEST_TOKEN" in proc.stderr and "0.0.0.0" in proc.stderr


def test_migrate_command_creates_the_schema_and_prints_the_revision(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "chunkledger", "migrate", "--db", f"duckdb:///{tmp_path}/m.duckdb"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["revision"] == head_revision()
    with duckdb.connect(str(tmp_path / "m.duckdb")) as con:
        tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    assert {"sources", "events", "steps", "requests", "alembic_version"} <= tables


def test_bad_database_url_is_a_clear_configuration_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "chunkledger", "migrate", "--db", "mysql://nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "db_url" in proc.stderr


def test_a_source_that_disconnects_mid_upload_is_not_a_server_error(ledger_server, tmp_path):
    """An exporter that times out halfway through a body: nothing stored, no traceback, ingest goes on."""
    import socket

    host, port = "127.0.0.1", ledger_server.port
    with socket.create_connection((host, port)) as s:
        s.sendall(
            b"POST /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n" + b'{"source": {"id": "half"'
        )
    evs = numbered([ev.Queued(seq=0, ts=1.0, request_id="after", prompt_tokens=3)])
    r = httpx.post(f"{ledger_server.url}/v1/events", content=body(ENGINE, evs))
    assert r.status_code == 200 and r.json()["accepted"] == 1
    ledger_server.stop()
    log = ledger_server.log_path.read_text()
    assert "Traceback" not in log and "disconnected while sending a batch" in log


def test_sigterm_answers_held_command_long_polls_and_exits_without_waiting_them_out(ledger_server):
    """A gateway's or engine's long-poll (wait_s up to 60) must not hold the shutdown: it is answered
    at once with no commands, and the server exits well inside uvicorn's 10 s graceful timeout."""
    import threading
    import time

    answers: list[httpx.Response] = []

    def poll() -> None:
        answers.append(
            httpx.get(
                f"{ledger_server.url}/v1/commands",
                params={"source_id": "gw-1", "wait_s": 60},
                timeout=90,
            )
        )

    polls = [threading.Thread(target=poll) for _ in range(2)]
    for t in polls:
        t.start()
    time.sleep(1.0)  # both are held by the server now
    assert not answers
    t0 = time.monotonic()
    ledger_server.stop()
    took = time.monotonic() - t0
    for t in polls:
        t.join(10)
    assert took < 5.0, f"shutdown took {took:.1f} s"
    assert [(r.status_code, r.json()) for r in answers] == [(200, {"commands": []})] * 2


def test_a_body_shorter_than_its_content_length_gets_a_408_instead_of_holding_the_connection(tmp_path):
    import socket
    import time

    server = LedgerServer(
        f"duckdb:///{tmp_path / 'l.duckdb'}", tmp_path / "ledger.log", env={"CHUNKLEDGER_BODY_TIMEOUT_S": "1"}
    )
    server.start()
    try:
        for method, path in (("POST", "/v1/events"), ("PUT", "/v1/policy"), ("POST", "/v1/sql")):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(
                    f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    'Content-Length: 100000\r\n\r\n{"source"'.encode()
                )
                t0 = time.monotonic()
                answer = b""
                while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    answer += chunk
                waited = time.monotonic() - t0
            assert answer.startswith(b"HTTP/1.1 408"), (path, answer[:200])
            assert b"request body not received within 1 s" in answer and 0.9 <= waited < 3, (path, waited)
        _, en = factories_lifecycle("after-408")
        assert httpx.post(f"{server.url}/v1/events", content=body(ENGINE, numbered(en))).status_code == 200
    finally:
        server.stop()
    assert "Traceback" not in (tmp_path / "ledger.log").read_text()
