"""An ASGI middleware that answers 408 when a request body stops arriving.

A client that sends ``Content-Length: 100000`` and then 10 bytes leaves the server waiting for the rest;
uvicorn has no body timeout, so such a request held its connection (and a handler) unanswered. Here the
wait for each part of the body is bounded: past ``timeout_s`` the client gets a 408 naming the reason,
the app sees the client as disconnected (nothing of the body is used), and whatever the app answers
afterwards is discarded. Once the body is complete, ``receive`` is passed through untouched (streaming
responses wait on it for the disconnect).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

log = logging.getLogger(__name__)

Message = dict[str, Any]


class BodyTimeoutMiddleware:
    def __init__(self, app: Any, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"body_done": False, "started": False, "answered": False}
        timeout_s = self.timeout_s

        async def guarded_send(message: Message) -> None:
            if state["answered"]:
                return  # the 408 went out already
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        async def guarded_receive() -> Message:
            if state["body_done"]:
                return await receive()  # type: ignore[no-any-return]
            try:
                async with asyncio.timeout(timeout_s):
                    message: Message = await receive()
            except TimeoutError:
                if not state["started"]:
                    body = json.dumps(
                        {
                            "reason": "body_timeout",
                            "detail": f"request body not received within {timeout_s:g} s (is Content-Length "
                            "larger than the body?)",
                        }
                    ).encode()
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 408,
                            "headers": [
                                (b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"),
                            ],
                        }
                    )
                    await send({"type": "http.response.body", "body": body})
                    state["answered"] = True
                state["body_done"] = True
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["body_done"] = True
            return message

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if not state["answered"]:
                raise
            # The app read the body and met the disconnect this middleware made up (FastAPI raises
            # ClientDisconnect): the 408 is the answer; there is no server error to report.
            log.info("%s %s: request body timed out (408)", scope.get("method"), scope.get("path"))
