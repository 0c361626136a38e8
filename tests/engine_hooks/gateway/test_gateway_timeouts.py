"""Slow clients at the gateway: a request head or body trickled a byte at a time does not hold its
connection past header_timeout_s / body_timeout_s (issue 35)."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx


def _answer(s: socket.socket, until: float) -> bytes:
    s.settimeout(max(0.05, until - time.monotonic()))
    data = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_trickled_heads_and_bodies_are_closed_at_their_timeouts(upstream, make_gateway):
    gw = make_gateway(upstream.url, header_timeout_s=0.5, body_timeout_s=0.5)
    port = int(gw.url.rsplit(":", 1)[1])
    heads, bodies = [], []
    for _ in range(100):
        h = socket.create_connection(("127.0.0.1", port))
        h.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        heads.append(h)
        b = socket.create_connection(("127.0.0.1", port))
        b.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10000\r\n\r\n{"
        )
        bodies.append(b)
    t0 = time.monotonic()
    for _ in range(3):  # a byte every 0.2 s: faster than any per-read timeout would notice
        time.sleep(0.2)
        for s in heads + bodies:
            with contextlib.suppress(OSError):
                s.sendall(b"x")
    for s in heads:
        assert _answer(s, t0 + 2.0) == b""  # closed without an answer
    for s in bodies:
        answer = _answer(s, t0 + 2.0)
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in answer, answer[:200]
    assert time.monotonic() - t0 < 2.5
    for s in heads + bodies:
        s.close()
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=10)
    assert r.status_code == 200  # the gateway serves on
