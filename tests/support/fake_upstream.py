"""A small OpenAI-compatible upstream for gateway tests and the gateway benchmark (a real HTTP server).

It answers ``/v1/completions`` and ``/v1/chat/completions`` the way vLLM's OpenAI server does (SSE
chunks ending with ``data: [DONE]``, or one JSON body), ``/v1/models``, ``/health`` (``x-fake:
engine-dead``: 503) and ``/version``. The request header
``x-fake`` picks a fault:

* ``status-500``: HTTP 500 with an error body;
* ``hang-after-N``: stream N chunks, then send nothing until the client goes away;
* ``split``: the stream's bytes are written in odd pieces (events split mid-line, a multi-byte
  character split in two, several events in one write);
* ``slow-headers-S``: wait S seconds before the response headers;
* ``close-after-N``: stream N chunks, then drop the connection without ending the stream;
* ``linger-after-done-S``: stream everything through ``data: [DONE]``, then wait S seconds (or until the
  client goes away) before ending the body.

``x-fake-delay-ms`` spaces the chunks (on a fixed timeline: chunk i is due i x delay after the
first). ``max_tokens`` in the body sets how many chunks (default 5).
Every request is recorded (path, headers, parsed body), and so is every request whose client went away
before its response was complete (``disconnected``, by X-Request-Id), so tests can check that the
gateway aborted the upstream. Run standalone: ``python fake_upstream.py --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Recorded:
    def __init__(self, path: str, headers: dict[str, str], body: Any, query: str = "", client: Any = None):
        self.path = path
        self.client = client  # (host, port) of the connection it came on
        self.query = query
        self.headers = headers
        self.body = body

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")


def chunk_event(chat: bool, rid: str, i: int, finish: str | None, text: str | None = None) -> bytes:
    piece = text if text is not None else f"tok{i} "
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": piece},
            "logprobs": None,
            "finish_reason": finish,
        }
        obj = {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": "fake-model",
            "choices": [choice],
        }
    else:
        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": 1700000000,
            "model": "fake-model",
            "choices": [choice],
        }
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def stream_bytes(chat: bool, rid: str, n: int) -> list[bytes]:
    """The events of a complete stream, as the upstream writes them (one event per write)."""
    events = [chunk_event(chat, rid, i, "length" if i == n - 1 else None) for i in range(n)]
    return [*events, b"data: [DONE]\n\n"]


def split_writes(chat: bool, rid: str) -> list[bytes]:
    """A stream written in awkward pieces: the concatenation is a valid SSE stream."""
    events = [
        chunk_event(chat, rid, 0, None, "héllo "),
        chunk_event(chat, rid, 1, None, "wörld ✓ "),
        chunk_event(chat, rid, 2, None, "x"),
        chunk_event(chat, rid, 3, "stop", ""),
    ]
    data = b"".join(events) + b"data: [DONE]\n\n"
    first = events[0]
    mid = data.index("ö".encode()) + 1  # inside the two bytes of "ö"
    cuts = [7, len(first) - 1, len(first) + 1, mid, mid + 30, len(data) - 3]
    pieces, start = [], 0
    for cut in cuts:
        pieces.append(data[start:cut])
        start = cut
    pieces.append(data[start:])
    return pieces


class FakeUpstream:
    """The ASGI app; state is read by the tests (same process) or only served (subprocess)."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.disconnected: list[str] = []
        self.completed: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        path = scope["path"]
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        self.requests.append(
            Recorded(path, headers, parsed, scope.get("query_string", b"").decode(), scope.get("client"))
        )
        if path == "/v1/models":
            await self._json(send, 200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
            return
        if path == "/health":  # vLLM's: an empty body, 503 once its engine is dead
            status = 503 if headers.get("x-fake") == "engine-dead" else 200
            await send(
                {"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]}
            )
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/version":
            await self._json(send, 200, {"version": "0.0.0-fake"})
            return
        rid = headers.get("x-request-id", "none")
        fault = headers.get("x-fake", "")
        delay = float(headers.get("x-fake-delay-ms", "0")) / 1000
        chat = path.endswith("/chat/completions")
        n = int((parsed or {}).get("max_tokens") or 5)
        if fault.startswith("slow-headers-"):
            await asyncio.sleep(float(fault.rsplit("-", 1)[1]))
        if fault == "status-500":
            await self._json(
                send,
                500,
                {
                    "error": {
                        "message": "upstream exploded",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
            )
            return
        if not (parsed or {}).get("stream"):
            text = "".join(f"tok{i} " for i in range(n))
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
            else:
                choice = {"index": 0, "text": text, "finish_reason": "length"}
            if delay:  # generating: a client that goes away aborts it, as in vLLM
                waiting = asyncio.ensure_future(receive())
                done, _ = await asyncio.wait({waiting}, timeout=delay * n)
                if done and waiting.result()["type"] == "http.disconnect":
                    self.disconnected.append(rid)
                    return
                waiting.cancel()
            await self._json(
                send,
                200,
                {
                    "id": f"cmpl-{rid}",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": 1700000000,
                    "model": "fake-model",
                    "choices": [choice],
                },
            )
            self.completed.append(rid)
            return
        gone = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gone.set()
                    return

        watcher = asyncio.ensure_future(watch())
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-upstream", b"fake")],
            }
        )
        writes = split_writes(chat, rid) if fault == "split" else stream_bytes(chat, rid, n)
        hang_after = (
            int(fault.rsplit("-", 1)[1]) if fault.startswith(("hang-after-", "close-after-")) else None
        )
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            for i, data in enumerate(writes):
                if gone.is_set():
                    break
                if hang_after is not None and i == hang_after:
                    if fault.startswith("close-after-"):
                        raise RuntimeError("fake upstream drops the connection")  # uvicorn closes it
                    await asyncio.wait_for(gone.wait(), timeout=120)
                    break
                await send({"type": "http.response.body", "body": data, "more_body": True})
                if delay:  # chunk i+1 is due at start + (i+1) x delay: late wake-ups do not add up
                    await asyncio.sleep(max(0.0, started + (i + 1) * delay - loop.time()))
            else:
                if fault.startswith("linger-after-done-"):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gone.wait(), timeout=float(fault.rsplit("-", 1)[1]))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                self.completed.append(rid)
        finally:
            watcher.cancel()
        if gone.is_set():
            self.disconnected.append(rid)

    async def _json(self, send: Send, status: int, obj: Any, delay: float = 0.0) -> None:
        if delay:
            await asyncio.sleep(delay)
        body = json.dumps(obj).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-upstream", b"fake"),
                    (b"set-cookie", b"fake-session=1; Path=/"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    print(f"fake upstream on {args.port} at {time.time()}", flush=True)
    uvicorn.run(FakeUpstream(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
