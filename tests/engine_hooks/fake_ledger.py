"""A small stand-in for the ledger's ingest endpoint, for exporter tests.

It speaks the real wire contract (``POST /v1/events`` -> ``IngestResponse``), validates batches with
the contract's decoder, dedupes by (source id, seq) and records arrival order. It can run in a thread
(tests take it down, bring it up on the same port, make it answer errors) or as a subprocess with a
SQLite file (``python fake_ledger.py --port P --db FILE``), so that a SIGKILL loses exactly what a real
ledger would: nothing it acknowledged, since it commits before it answers.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec

from engine_hooks.events import Command, IngestResponse, batch_decoder

_response_encoder = msgspec.json.Encoder()


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


class Store:
    """Stored events: (source id, seq) -> kind, kept in arrival order; optionally in SQLite."""

    def __init__(self, db_path: str | None = None):
        self.lock = threading.Lock()
        self.db = sqlite3.connect(db_path, check_same_thread=False) if db_path else None
        if self.db is not None:
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS events (n INTEGER PRIMARY KEY AUTOINCREMENT, source_id TEXT, "
                "seq INTEGER, kind TEXT, body TEXT, UNIQUE (source_id, seq))"
            )
            self.db.commit()
        self.rows: list[tuple[str, int, str]] = []
        self.events: list[Any] = []
        self.keys: set[tuple[str, int]] = set()
        self.posts = 0

    def add(self, source_id: str, events: list[Any]) -> tuple[int, int]:
        accepted = duplicates = 0
        with self.lock:
            self.posts += 1
            for event in events:
                key = (source_id, event.seq)
                if key in self.keys:
                    duplicates += 1
                    continue
                kind = type(event).__struct_config__.tag
                if self.db is not None:
                    self.db.execute(
                        "INSERT OR IGNORE INTO events (source_id, seq, kind, body) VALUES (?, ?, ?, ?)",
                        (source_id, event.seq, kind, msgspec.json.encode(event).decode()),
                    )
                self.keys.add(key)
                self.rows.append((source_id, event.seq, kind))
                self.events.append(event)
                accepted += 1
            if self.db is not None:
                self.db.commit()
        return accepted, duplicates


class FakeLedger:
    """In-thread fake ledger. ``status`` forces an HTTP status; ``commands`` are sent with each answer."""

    def __init__(self, port: int = 0, token: str | None = None, db_path: str | None = None):
        self.store = Store(db_path)
        self.token = token
        self.status: int | None = None  # answer every POST with this status (None: normal ingest)
        self.fail_next: list[int] = []  # statuses for the next POSTs, one each, before normal ingest
        self.delay_s = 0.0
        self.commands: list[Command] = []
        self.poll_commands: list[Command] = []  # answered to GET /v1/commands
        self.polls: list[str] = []  # the query string of each GET /v1/commands
        self.auth_headers: list[str | None] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self.port = port
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def rows(self) -> list[tuple[str, int, str]]:
        return list(self.store.rows)

    def start(self) -> None:
        if self._server is not None:
            return
        ledger = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                ledger._connections.add(self.connection)

            def finish(self) -> None:
                ledger._connections.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def do_GET(self) -> None:
                if self.path.startswith("/v1/commands"):
                    ledger.polls.append(self.path.partition("?")[2])
                    body = _response_encoder.encode({"commands": list(ledger.poll_commands)})
                    self._answer(200, body)
                    return
                self._answer(200, b'{"status":"ok"}')

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                ledger.auth_headers.append(self.headers.get("authorization"))
                if ledger.delay_s:
                    threading.Event().wait(ledger.delay_s)
                forced = ledger.fail_next.pop(0) if ledger.fail_next else ledger.status
                if forced is not None:
                    self._answer(forced, b'{"detail":"forced by the test"}')
                    return
                if ledger.token and self.headers.get("authorization") != f"Bearer {ledger.token}":
                    self._answer(401, b'{"detail":"bad token"}')
                    return
                try:
                    batch = batch_decoder.decode(body)
                except msgspec.DecodeError as exc:
                    self._answer(422, _response_encoder.encode({"detail": str(exc)}))
                    return
                accepted, duplicates = ledger.store.add(batch.source.id, batch.events)
                answer = IngestResponse(
                    accepted=accepted, duplicates=duplicates, commands=list(ledger.commands)
                )
                self._answer(200, _response_encoder.encode(answer))

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        ThreadingHTTPServer.allow_reuse_address = True
        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and cut open keep-alive connections (clients then see refused connections)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        for conn in list(self._connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--db", required=True)
    args = parser.parse_args()
    ledger = FakeLedger(port=args.port, db_path=args.db)
    print(f"listening {ledger.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
