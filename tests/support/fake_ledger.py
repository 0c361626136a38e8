"""A small stand-in for the ledger's ingest endpoint, for exporter tests.

It speaks the real wire contract in JSON only, as a ledger that predates the columnar message (another
``Content-Type`` gets a 415) (``POST /v1/events`` -> ``IngestResponse``), validates batches with
the contract's decoder and dedupes by (source id, seq). Stored rows are kept in arrival order, except
that each source's events stay in seq order (the order the exporter numbered them in): a batch that
arrives after a newer one of its source (the exporter keeps several in flight) is placed where its seqs
belong, as a reader of the real ledger ordering by seq sees it. ``posts`` logs each POST's arrival and
answer times, for tests about what was in flight when. It can run in a thread
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
from dataclasses import dataclass
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


@dataclass
class Post:
    """One POST /v1/events as the fake ledger saw it (monotonic times)."""

    arrived: float
    source_id: str = ""
    first_seq: int = -1
    last_seq: int = -1
    answered: float | None = None
    status: int | None = None


class Store:
    """Stored events: (source id, seq) -> kind, in arrival order with each source in seq order; optionally
    in SQLite."""

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
        self.last_seq: dict[str, int] = {}  # highest stored seq per source
        self.posts = 0
        self.duplicates = 0  # events received again after they were stored

    def add(self, source_id: str, events: list[Any]) -> tuple[int, int]:
        accepted = duplicates = 0
        with self.lock:
            self.posts += 1
            for event in events:
                key = (source_id, event.seq)
                if key in self.keys:
                    duplicates += 1
                    self.duplicates += 1
                    continue
                kind = type(event).__struct_config__.tag
                if self.db is not None:
                    self.db.execute(
                        "INSERT OR IGNORE INTO events (source_id, seq, kind, body) VALUES (?, ?, ?, ?)",
                        (source_id, event.seq, kind, msgspec.json.encode(event).decode()),
                    )
                self.keys.add(key)
                row = (source_id, event.seq, kind)
                if event.seq > self.last_seq.get(source_id, -1):
                    self.last_seq[source_id] = event.seq
                    self.rows.append(row)
                    self.events.append(event)
                else:  # a late batch: before the first stored event of its source with a higher seq
                    at = next(
                        i for i, (sid, seq, _) in enumerate(self.rows) if sid == source_id and seq > event.seq
                    )
                    self.rows.insert(at, row)
                    self.events.insert(at, event)
                accepted += 1
            if self.db is not None:
                self.db.commit()
        return accepted, duplicates


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # listen backlog: several exporters open several connections at once
    # (socketserver's default of 5 drops SYNs, which clients see as a 1 s connect timeout)


class FakeLedger:
    """In-thread fake ledger. ``status`` forces an HTTP status; ``commands`` are sent with each answer."""

    def __init__(self, port: int = 0, token: str | None = None, db_path: str | None = None):
        self.store = Store(db_path)
        self.token = token
        self.status: int | None = None  # answer every POST with this status (None: normal ingest)
        self.fail_next: list[int] = []  # statuses for the next POSTs, one each, before normal ingest
        self.delay_s = 0.0  # every POST waits this long before it is handled
        self.delays: list[float] = []  # extra waits for the next POSTs, one each
        self.fail_if: Callable[[Any], int | None] | None = None  # batch -> forced status, or None
        self.posts: list[Post] = []  # every POST /v1/events, in arrival order
        self.in_flight = 0  # POSTs being handled now
        self.max_in_flight = 0  # the most POSTs handled at once so far
        self.commands: list[Command] = []
        self.poll_commands: list[Command] = []  # answered to GET /v1/commands
        self.polls: list[str] = []  # the query string of each GET /v1/commands
        self.auth_headers: list[str | None] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
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
                post = Post(arrived=time.monotonic())
                with ledger._lock:  # what this POST gets is decided when it arrives
                    ledger.posts.append(post)
                    ledger.in_flight += 1
                    ledger.max_in_flight = max(ledger.max_in_flight, ledger.in_flight)
                    ledger.auth_headers.append(self.headers.get("authorization"))
                    delay = ledger.delay_s + (ledger.delays.pop(0) if ledger.delays else 0.0)
                    forced = ledger.fail_next.pop(0) if ledger.fail_next else ledger.status
                    fail_if = ledger.fail_if
                try:
                    batch = batch_decoder.decode(body)
                except msgspec.DecodeError:
                    batch = None
                if batch is not None:
                    post.source_id = batch.source.id
                    if batch.events:
                        post.first_seq, post.last_seq = batch.events[0].seq, batch.events[-1].seq
                    if forced is None and fail_if is not None:
                        forced = fail_if(batch)
                try:
                    if delay:
                        threading.Event().wait(delay)
                    status, reply = self._ingest(body, batch, forced)
                    post.status = status
                finally:
                    # recorded before the client can read the answer: a test that sees its flush
                    # acknowledged sees the POST answered too
                    post.answered = time.monotonic()
                    with ledger._lock:
                        ledger.in_flight -= 1
                self._answer(status, reply)

            def _ingest(self, body: bytes, batch: Any, forced: int | None) -> tuple[int, bytes]:
                if forced is not None:
                    return forced, b'{"detail":"forced by the test"}'
                if ledger.token and self.headers.get("authorization") != f"Bearer {ledger.token}":
                    return 401, b'{"detail":"bad token"}'
                media = (self.headers.get("content-type") or "").split(";")[0].strip()
                if media not in ("", "application/json"):  # JSON only, as a ledger before the columns
                    return 415, b'{"reason":"unsupported_media_type"}'
                if batch is None:
                    try:
                        batch_decoder.decode(body)
                    except msgspec.DecodeError as exc:
                        return 422, _response_encoder.encode({"detail": str(exc)})
                accepted, duplicates = ledger.store.add(batch.source.id, batch.events)
                answer = IngestResponse(
                    accepted=accepted, duplicates=duplicates, commands=list(ledger.commands)
                )
                return 200, _response_encoder.encode(answer)

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        ThreadingHTTPServer.allow_reuse_address = True
        server = _Server(("127.0.0.1", self.port), Handler)
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
