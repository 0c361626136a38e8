"""The request body's two limits, enforced while the app reads it: its size and its deadline.

* **Size.** A ``Content-Length`` above the route's limit is answered 413 before the app runs (nothing is
  read); a body that turns out larger (chunked, or longer than it said) is cut at the limit with 413.
* **Deadline.** The whole body must arrive within ``timeout_s`` of the request head: a client that sends
  ``Content-Length: 100000`` and then 10 bytes, or trickles one byte every few seconds, gets 408. (A
  wait per part alone would let a trickle hold its connection and a handler for ever.)

Either way the client gets the answer at once, the app sees the client as disconnected (nothing of the
body is used), and whatever the app answers afterwards is discarded. Once the body is complete,
``receive`` is passed through untouched (streaming responses wait on it for the disconnect).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

Message = dict[str, Any]


async def send_error(send: Any, status: int, reason: str, detail: str, **extra: Any) -> None:
    """A complete JSON error answer (the API's one error body) that closes the connection."""
    body = json.dumps({"reason": reason, "detail": detail, **extra}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if status == 429 and "retry_after" in extra:
        headers.append((b"retry-after", str(extra["retry_after"]).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _declared_length(scope: Message) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def guard_body(
    app: Any,
    scope: Message,
    receive: Any,
    send: Any,
    *,
    timeout_s: float,
    max_bytes: int | None,
    limit: str = "",
) -> None:
    """Run ``app`` with the body limits; ``limit`` names the size setting in a 413. ``max_bytes`` None:
    the route checks the size itself (ingest, which counts its refusals)."""
    declared = _declared_length(scope)
    too_large = f"body larger than {max_bytes} bytes ({limit})"
    if max_bytes is not None and declared is not None and declared > max_bytes:
        await send_error(send, 413, "too_large", too_large + "; nothing was read", limit=limit)
        return
    state = {"body_done": declared == 0, "started": False, "answered": False, "size": 0}
    deadline = time.monotonic() + timeout_s

    async def guarded_send(message: Message) -> None:
        if state["answered"]:
            return  # the 408/413 went out already
        if message["type"] == "http.response.start":
            state["started"] = True
        await send(message)

    async def refuse(status: int, reason: str, detail: str, **extra: Any) -> Message:
        if not state["started"]:
            await send_error(send, status, reason, detail, **extra)
            state["answered"] = True
        state["body_done"] = True
        return {"type": "http.disconnect"}

    async def guarded_receive() -> Message:
        if state["body_done"]:
            return await receive()  # type: ignore[no-any-return]
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                message: Message = await receive()
        except TimeoutError:
            return await refuse(
                408,
                "body_timeout",
                f"request body not received within {timeout_s:g} s (body_timeout_s; is Content-Length "
                "larger than the body?)",
                limit="body_timeout_s",
            )
        if message["type"] == "http.request":
            state["size"] += len(message.get("body", b""))
            if max_bytes is not None and state["size"] > max_bytes:
                return await refuse(413, "too_large", too_large, limit=limit)
        if message["type"] != "http.request" or not message.get("more_body", False):
            state["body_done"] = True
        return message

    try:
        await app(scope, guarded_receive, guarded_send)
    except Exception:
        if not state["answered"]:
            raise
        # The app read the body and met the disconnect made up here (FastAPI raises ClientDisconnect):
        # the 408/413 is the answer; there is no server error to report.
        log.info("%s %s: request body refused by its limits", scope.get("method"), scope.get("path"))
