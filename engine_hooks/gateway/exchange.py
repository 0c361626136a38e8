"""One generation request in the gateway, from its arrival to its last write: :class:`Exchange`.

The exchange carries the request's context, so that the gateway's handlers (app.py) and the relay
(relay.py) take it instead of a list of loose values: the request id, what the client asked for
(endpoint, stream or not, how many choices, model, priority), the clocks read at arrival, the client's
ASGI ``receive`` and ``send``, the upstream's response once there is one, and the flags of an
interruption (a cutoff command or a client disconnect; app.py says who sets them and when a cancel is
safe).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from engine_hooks.events import Command
from engine_hooks.tracecontext import (
    SAMPLED,
    format_traceparent,
    new_span_id,
    new_trace_id,
    parse_traceparent,
    valid_tracestate,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class GatewaySpan:
    """The gateway's span of one request (W3C Trace Context): in the client's trace when its
    ``traceparent`` is valid (the client's span its parent, its ``tracestate`` passed on), else the root
    of a new trace. The engine gets it as its parent (:meth:`upstream_headers`), so vLLM's own
    ``llm_request`` span and the ledger's spans of the request are one trace under it."""

    __slots__ = ("flags", "parent_span_id", "span_id", "trace_id", "tracestate")

    def __init__(self, traceparent: bytes | None, tracestate: bytes | None):
        parent = parse_traceparent(traceparent)
        self.span_id = new_span_id()
        if parent is None:
            self.trace_id, self.parent_span_id, self.flags = new_trace_id(), None, SAMPLED
            self.tracestate: bytes | None = None
        else:
            self.trace_id, self.parent_span_id, self.flags = parent
            state = valid_tracestate(tracestate)
            self.tracestate = state.encode() if state is not None else None

    def upstream_headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"traceparent", format_traceparent(self.trace_id, self.span_id, self.flags).encode())]
        if self.tracestate is not None:
            out.append((b"tracestate", self.tracestate))
        return out


class Exchange:
    """One generation request: its context and what interrupts it.

    Built first thing on arrival, in the request's own task: ``t0`` (monotonic; every duration in the
    request's events starts there) and ``ts0`` (the wall clock, the ``arrived`` event's ``ts``) are read
    here, and the request id is a new one until the client's ``X-Request-Id`` replaces it."""

    __slots__ = (
        "body",
        "cancel_pending",
        "chat",
        "choices",
        "command",
        "disconnected",
        "done",
        "interruptible",
        "model",
        "path",
        "priority",
        "receive",
        "request_id",
        "response",
        "scope",
        "send",
        "started",
        "stream",
        "t0",
        "task",
        "trace",
        "ts0",
    )

    def __init__(self, scope: Scope, receive: Receive, send: Send, chat: bool):
        self.t0 = time.monotonic()
        self.ts0 = time.time()
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.request_id = os.urandom(16).hex()  # 32 random hex digits like uuid4().hex, for less CPU
        # What the client asked for (the body's fields are filled in once it is read and checked).
        self.scope = scope
        self.path: str = scope["path"]
        self.chat = chat
        self.stream = False
        self.choices = 1  # the body's n
        self.model: str | None = None  # the body's model, when a string
        self.priority = 0
        self.body = b""  # what goes upstream: the client's JSON plus the request id in vllm_xargs
        self.trace: GatewaySpan | None = None  # the request's span in the client's trace, or a new trace
        # The client's side and the upstream's.
        self.receive = receive
        self.send = send
        self.started = False  # the response's head was sent to the client
        self.response: httpx.Response | None = None  # the upstream's, once its head arrived
        # Interruptions.
        self.command: Command | None = None  # the cutoff command that ends it
        self.disconnected = False
        self.interruptible = False  # awaiting the queue or the upstream: safe to cancel
        self.cancel_pending = False  # we cancelled the task and owe it an uncancel()
        self.done = False

    @property
    def interrupted(self) -> bool:
        return self.disconnected or self.command is not None

    def interrupt(self) -> None:
        if self.interruptible and not self.cancel_pending and not self.done:
            self.cancel_pending = True
            self.task.cancel()

    def absorb_cancel(self) -> bool:
        """In an ``except CancelledError``: True (and the cancel undone) when it was an interruption."""
        self.interruptible = False
        if self.cancel_pending:
            self.cancel_pending = False
            self.task.uncancel()
            return True
        return False
