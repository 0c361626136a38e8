"""The gateway: an OpenAI-compatible streaming proxy with an admission queue, as a plain ASGI app.

Per generation request (``POST /v1/completions``, ``POST /v1/chat/completions``)::

    arrived ── read + parse body, assign the request id ── admission_enqueued (entry_s)
            ── wait for one of max_in_flight upstream slots ── admitted (wait_s)
            ── forward (httpx's pooled transport, upstream.py) ── first_byte ── relay ── completed

The request id is the client's ``X-Request-Id`` or a new one; it goes upstream in that header (vLLM's
OpenAI server uses it for its own request id) and in the body as
``vllm_xargs.chunkledger_request_id``, which vLLM copies into ``SamplingParams.extra_args`` where the
engine hook reads it, so gateway and engine rows of the ledger join. Durations in events are measured
with the monotonic clock; ``ts`` is the wall clock.

Streams (``text/event-stream``) are relayed as the upstream's bytes arrive, unchanged, one write to
the client per socket read from the upstream (events that arrived together go out together); only a
partial SSE event at the end of a read is held until its blank line arrives, so the gateway can always
end a stream on an event boundary. Other responses are read whole and relayed with their status, headers and
raw (still encoded) body.

Interruptions: a cutoff command from the ledger (``on_command``, on the exporter's thread, handed to
the event loop) or a client disconnect (a watcher task on ``receive()``) marks the request's exchange
and cancels its task only while it awaits the upstream or the queue, never in the middle of a write
to the client. The handler then ends the stream with a final chunk naming the rule and ``[DONE]`` (a
cut), or an error response (a cut before any byte was sent, non-streaming), and closes the upstream
response, which closes its connection: vLLM aborts a request whose client went away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine_hooks.config import ExporterConfig
from engine_hooks.events import (
    AdmissionEnqueued,
    Admitted,
    Arrived,
    ClientDisconnected,
    Command,
    Completed,
    CutoffApplied,
    FirstByte,
    FirstTokenOut,
    StreamCut,
)
from engine_hooks.exporter import Exporter
from engine_hooks.gateway.admission import AdmissionQueue, AdmissionRefused
from engine_hooks.gateway.config import GatewayConfig
from engine_hooks.gateway.metrics import GatewayMetrics
from engine_hooks.gateway.responses import (
    ends_stream,
    error_body,
    error_object,
    event_boundary,
    final_chunk,
    has_choice,
    last_finish_reason,
)
from engine_hooks.gateway.upstream import BODY_COMPLETE, upstream_transport

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

XARGS_KEY = "chunkledger_request_id"
CUT_STATUS = 400  # non-streaming answer to a cut: a 4xx that OpenAI clients do not retry
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
_DROP_REQUEST = _HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding"}
_DROP_RESPONSE = _HOP_BY_HOP | {b"content-length"}
_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,256}$")  # visible ASCII: fits a header and the contract
_MAX_BODY = 64 << 20
_decode = msgspec.json.decode
_encode = msgspec.json.encode


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# After relaying [DONE], how long the upstream may take to end its body before its connection is
# closed instead of going back to the pool.
_DRAIN_AFTER_DONE_S = 1.0


class _OutTimes:
    """When the generated content of one response was written to the client: the first write (the
    client's time to first token; a ``first_token_out`` event and the TTFT histogram) and the last.

    The clock is read just before the write (:meth:`writing`), the event and the histogram follow it
    (:meth:`written`): a client cannot read content before it was written, and a stamp read after
    ``send`` returned could come tens of ms after the client's read on a busy host."""

    __slots__ = ("at", "at_wall", "first", "gateway", "last", "request_id", "t0")

    def __init__(self, gateway: Gateway, request_id: str, t0: float):
        self.gateway, self.request_id, self.t0 = gateway, request_id, t0
        self.first: float | None = None
        self.last: float | None = None
        self.at: float | None = None  # the clock before the write under way, when it holds content
        self.at_wall = 0.0  # and the wall clock then, while no content was written (the event's ts)

    def writing(self, data: bytes) -> None:
        """``data`` is about to be written to the client."""
        if has_choice(data):
            self.at = time.monotonic()
            if self.first is None:
                self.at_wall = time.time()
        else:
            self.at = None

    def written(self) -> None:
        """The data of the last :meth:`writing` was written (a write that raised is not counted)."""
        if self.at is None:
            return
        self.last, self.at = self.at, None
        if self.first is None:
            self.first = self.last
            since = self.first - self.t0
            self.gateway.e_first_token_out(self.at_wall, self.request_id, since)
            self.gateway.metrics.first_token.observe(since)


class _Exchange:
    """One generation request in the gateway: what interrupts it and how."""

    __slots__ = ("cancel_pending", "command", "disconnected", "done", "interruptible", "request_id", "task")

    def __init__(self, request_id: str, task: asyncio.Task[Any]):
        self.request_id = request_id
        self.task = task
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


class Gateway:
    """The ASGI app. ``exporter_config``: where events go (None: no events, e.g. no ledger configured)."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        exporter_config: ExporterConfig | None = None,
        registry: CollectorRegistry | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.config = config
        self.queue = AdmissionQueue(
            config.max_in_flight, config.max_queue, config.max_queue_wait_s, config.retry_after_s
        )
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = GatewayMetrics(
            self.registry,
            depth=lambda: self.queue.depth,
            in_flight=lambda: self.queue.in_flight,
            max_in_flight=config.max_in_flight,
        )
        self.exporter_config = exporter_config
        self.exporter: Exporter | None = None
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._pool: httpx.AsyncBaseTransport | None = None
        self._timeouts: dict[str, float | None] = {}
        self._urls: dict[str, httpx.URL] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._active: dict[str, _Exchange] = {}
        self._request_id_header = config.request_id_header.lower().encode()
        self._priority_header = config.priority_header.lower().encode()
        self._retry_after = str(max(1, math.ceil(config.retry_after_s))).encode()
        Emit = Callable[..., None]
        self.e_arrived: Emit
        self.e_enqueued: Emit
        self.e_admitted: Emit
        self.e_first_byte: Emit
        self.e_first_token_out: Emit
        self.e_completed: Emit
        self.e_disconnected: Emit
        self.e_cut: Emit
        self.e_applied: Emit
        self._emit_off()

    # -- life cycle -------------------------------------------------------------------------------

    async def startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        limits = httpx.Limits(
            max_connections=self.config.max_in_flight + 16,
            max_keepalive_connections=self.config.max_in_flight + 16,
            keepalive_expiry=4.0,  # below uvicorn's 5 s keep-alive, so a pooled connection is never stale
        )
        timeout = httpx.Timeout(
            connect=self.config.connect_timeout_s,
            read=self.config.read_timeout_s,
            write=self.config.read_timeout_s,
            pool=self.config.max_queue_wait_s,
        )
        # One connection pool for everything upstream. Generation requests go to the transport directly:
        # no cookie jar (a proxy must not keep one client's cookies for the next), no auth or redirect
        # handling, about a quarter less CPU per request than AsyncClient.send. For an http:// upstream
        # the pool's connections parse with httptools (upstream.py). /v1/models uses the client on top
        # of the same pool.
        self._pool = self._transport or upstream_transport(self.config.upstream_base, limits)
        self._client = httpx.AsyncClient(transport=self._pool, timeout=timeout, trust_env=False)
        self._timeouts = timeout.as_dict()
        self._urls = {path: httpx.URL(self.config.upstream_base + path) for path in _ENDPOINTS}
        if self.exporter_config is not None:
            # Commands reach on_command through the exporter, once per command id (its
            # CommandDeduper): on ingest answers and, when poll_commands is on, by its long-poll of
            # GET /v1/commands (CommandPoller), held for the gateway's command_poll_wait_s.
            wait_s = self.config.command_poll_wait_s if self.config.poll_commands else 0.0
            exporter_config = msgspec.structs.replace(self.exporter_config, command_poll_wait_s=wait_s)
            self.exporter = Exporter(exporter_config, on_command=self.on_command, registry=self.registry)
            self._emit_on(self.exporter)

    async def shutdown(self) -> None:
        if self._client is not None:
            await self._client.aclose()  # closes the pool too
            self._client = self._pool = None
        if self.exporter is not None:
            exporter, self.exporter = self.exporter, None
            self._emit_off()
            await asyncio.get_running_loop().run_in_executor(None, exporter.shutdown, None)

    def _emit_on(self, exporter: Exporter) -> None:
        e = exporter.emitter
        self.e_arrived = e(Arrived, "ts", "request_id", "endpoint", "stream", "priority")
        self.e_enqueued = e(AdmissionEnqueued, "request_id", "queue_depth", "entry_s")
        self.e_admitted = e(Admitted, "request_id", "wait_s", "in_flight")
        self.e_first_byte = e(FirstByte, "request_id", "since_arrived_s")
        self.e_first_token_out = e(FirstTokenOut, "ts", "request_id", "since_arrived_s")
        self.e_completed = e(
            Completed, "request_id", "status_code", "since_arrived_s", "finish_reason", "last_token_out_s"
        )
        self.e_disconnected = e(ClientDisconnected, "request_id", "since_arrived_s", "last_token_out_s")
        self.e_cut = e(StreamCut, "request_id", "rule", "command_id")
        self.e_applied = e(CutoffApplied, "request_id", "command_id", "action", "rule")

    def _emit_off(self) -> None:
        def off(*values: Any) -> None:
            return None

        self.e_arrived = self.e_enqueued = self.e_admitted = self.e_first_byte = self.e_first_token_out = off
        self.e_completed = self.e_disconnected = self.e_cut = self.e_applied = off

    # -- commands from the ledger -----------------------------------------------------------------

    def on_command(self, command: Command) -> None:
        """Exporter sender or command-poll thread, once per command id: hand the command to the event
        loop (raises if the loop is gone, so the exporter does not remember it and the ledger sends it
        again)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the gateway's event loop is not running")
        loop.call_soon_threadsafe(self.apply_command, command)

    def apply_command(self, command: Command) -> None:
        """Event loop: cut the request the command names, if this gateway holds it."""
        self.metrics.commands.inc()
        if command.action != "abort":
            return  # slow_pool, non_preemptible, promote: engine-side actions
        exchange = self._active.get(command.request_id)
        if exchange is None or exchange.done or exchange.interrupted:
            log.debug("cutoff command %s for request %s not held here", command.id, command.request_id)
            return
        exchange.command = command
        exchange.interrupt()

    # -- ASGI -------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        endpoint = _ENDPOINTS.get(path)
        if endpoint is not None:
            if method != "POST":
                await _json(send, 405, error_body(f"{path} takes POST", "invalid_request_error", 405))
                return
            self.metrics.requests[endpoint].inc()
            await self._generate(scope, receive, send, endpoint == "chat_completions")
        elif path == "/v1/models":
            self.metrics.requests["models"].inc()
            await self._relay_plain(scope, receive, send)
        elif path == "/metrics":
            await _send_all(
                send, 200, [(b"content-type", CONTENT_TYPE_LATEST.encode())], generate_latest(self.registry)
            )
        elif path in ("/healthz", "/health"):
            await _json(send, 200, b'{"status":"ok"}')
        else:
            await _json(
                send,
                404,
                error_body(f"no route {method} {path} in the chunkledger gateway", "not_found_error", 404),
            )

    # -- generation requests ----------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        t0 = time.monotonic()
        ts0 = time.time()
        path = scope["path"]
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        client_id = priority_raw = None
        for name, value in headers:
            if name == self._request_id_header:
                client_id = value
            elif name == self._priority_header:
                priority_raw = value
        request_id = os.urandom(16).hex()  # 32 random hex digits like uuid4().hex, for less CPU
        try:
            body = await _read_body(receive)
        except _Disconnected:
            return
        except BadRequest as exc:
            await _json(
                send,
                413,
                error_body(str(exc), "invalid_request_error", 413),
                request_id,
                self._request_id_header,
            )
            return
        try:
            if client_id is not None:
                request_id = _request_id(client_id, self.config.request_id_header)
            priority = _priority(priority_raw, self.config.priority_header)
            payload, stream, choices = _parse_body(body)
        except BadRequest as exc:
            self.e_arrived(ts0, request_id, path, False, 0)
            self._finish(request_id, t0, 400, None, "bad_request")
            await _json(
                send,
                400,
                error_body(str(exc), "invalid_request_error", 400, exc.param),
                request_id,
                self._request_id_header,
            )
            return
        xargs = payload.get("vllm_xargs")
        payload["vllm_xargs"] = {**(xargs or {}), XARGS_KEY: request_id}
        upstream_body = _encode(payload)
        self.e_arrived(ts0, request_id, path, stream, priority)
        self.e_enqueued(request_id, self.queue.depth, time.monotonic() - t0)

        task = asyncio.current_task()
        assert task is not None
        exchange = _Exchange(request_id, task)
        self._active[request_id] = exchange
        watcher = asyncio.ensure_future(self._watch(receive, exchange))
        try:
            await self._admit_and_forward(
                exchange,
                scope,
                send,
                upstream_body,
                priority,
                stream,
                chat,
                choices,
                payload.get("model"),
                t0,
            )
        finally:
            exchange.done = True
            watcher.cancel()
            if self._active.get(request_id) is exchange:
                del self._active[request_id]

    async def _watch(self, receive: Receive, exchange: _Exchange) -> None:
        """Wait for the client to go away (``http.disconnect``) and interrupt the exchange."""
        while not exchange.done:
            message = await receive()
            if message["type"] == "http.disconnect":
                if not exchange.done:
                    exchange.disconnected = True
                    exchange.interrupt()
                return

    async def _admit_and_forward(
        self,
        exchange: _Exchange,
        scope: Scope,
        send: Send,
        body: bytes,
        priority: int,
        stream: bool,
        chat: bool,
        choices: int,
        model: Any,
        t0: float,
    ) -> None:
        rid = exchange.request_id
        exchange.interruptible = True
        try:
            wait_s = await self.queue.acquire(priority)
        except AdmissionRefused as exc:
            exchange.interruptible = False
            self._finish(rid, t0, exc.status, None, f"rejected_{exc.reason}")
            kind = "rate_limit_error" if exc.status == 429 else "service_unavailable"
            await _json(
                send,
                exc.status,
                error_body(str(exc), kind, exc.status),
                rid,
                self._request_id_header,
                extra=[(b"retry-after", self._retry_after)],
            )
            return
        except asyncio.CancelledError:
            if not exchange.absorb_cancel():
                raise
            await self._interrupted(exchange, send, stream, chat, choices, model, t0)
            return
        exchange.interruptible = False
        self.metrics.admission_wait.observe(wait_s)
        self.e_admitted(rid, wait_s, self.queue.in_flight)
        try:
            await self._forward(exchange, scope, send, body, stream, chat, choices, model, t0)
        finally:
            self.queue.release()

    async def _forward(
        self,
        exchange: _Exchange,
        scope: Scope,
        send: Send,
        body: bytes,
        stream: bool,
        chat: bool,
        choices: int,
        model: Any,
        t0: float,
    ) -> None:
        rid = exchange.request_id
        pool = self._pool
        assert pool is not None, "the gateway was not started (ASGI lifespan)"
        headers = _upstream_headers(scope["headers"], self._request_id_header, rid, stream)
        request = httpx.Request(
            "POST",
            self._urls[scope["path"]].copy_with(query=query)
            if (query := scope.get("query_string"))
            else self._urls[scope["path"]],
            headers=headers,
            content=body,
            extensions={"timeout": self._timeouts},
        )
        self.metrics.upstream_requests.inc()
        exchange.interruptible = True
        try:
            response = await pool.handle_async_request(request)
        except asyncio.CancelledError:
            if not exchange.absorb_cancel():
                raise
            await self._interrupted(exchange, send, stream, chat, choices, model, t0)
            return
        except httpx.HTTPError as exc:
            exchange.interruptible = False
            await self._upstream_failed(exchange, send, exc, t0)
            return
        exchange.interruptible = False
        try:
            since = time.monotonic() - t0
            self.e_first_byte(rid, since)
            self.metrics.first_byte.observe(since)
            if response.status_code >= 500:
                self.metrics.upstream_errors["status_5xx"].inc()
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                await self._relay_stream(exchange, response, send, chat, choices, model, t0)
            else:
                await self._relay_whole(exchange, response, send, stream, chat, choices, model, t0)
        finally:
            await response.aclose()  # mid-stream: closes the connection, so the upstream aborts

    async def _relay_stream(
        self,
        exchange: _Exchange,
        response: httpx.Response,
        send: Send,
        chat: bool,
        choices: int,
        model: Any,
        t0: float,
    ) -> None:
        """Relay an SSE stream chunk by chunk; end it ourselves on a cut, a timeout or a broken upstream."""
        rid = exchange.request_id
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": _client_headers(response, self._request_id_header, rid, None),
            }
        )
        chunks = aiter(_raw(response))
        body_complete = response.extensions.get(BODY_COMPLETE)  # our transport for http:// upstreams
        tail = b""  # an SSE event not complete yet
        first_events: bytes | None = None
        finish_reason: str | None = None
        ending: tuple[str, dict[str, Any], str] | None = None  # (finish reason, error, outcome)
        out_times = _OutTimes(self, rid, t0)
        done = False  # [DONE] relayed: the stream is complete for the client
        while not exchange.interrupted:
            exchange.interruptible = True
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                exchange.interruptible = False
                break
            except asyncio.CancelledError:
                if not exchange.absorb_cancel():
                    raise
                break
            except httpx.TimeoutException:
                exchange.interruptible = False
                self.metrics.upstream_errors["timeout"].inc()
                ending = (
                    "error",
                    error_object(
                        f"the upstream sent nothing for {self.config.read_timeout_s:g} s (read timeout); "
                        "the gateway ended the stream",
                        "upstream_timeout",
                        504,
                    ),
                    "upstream_timeout",
                )
                break
            except httpx.HTTPError as exc:
                exchange.interruptible = False
                self.metrics.upstream_errors["broken"].inc()
                ending = (
                    "error",
                    error_object(
                        f"the upstream connection broke mid-stream ({type(exc).__name__})",
                        "upstream_error",
                        502,
                    ),
                    "upstream_error",
                )
                break
            exchange.interruptible = False
            data = tail + chunk if tail else chunk
            cut = event_boundary(data)
            out, tail = data[:cut], data[cut:]
            if out:
                if first_events is None:
                    first_events = out
                reason = last_finish_reason(out)
                if reason is not None:
                    finish_reason = reason
            if body_complete is not None and body_complete():
                # The upstream's body ended with this piece: it goes out with the end of the stream,
                # in one write. The iterator has nothing left (no read), so it is run to its end.
                with contextlib.suppress(StopAsyncIteration):
                    await chunks.__anext__()
                tail = data
                break
            if out and ends_stream(out) and not tail:
                # [DONE]: the client has it all once this piece is written; its closing the connection
                # now is no disconnect. The upstream's end of body is awaited after the response.
                tail, done = out, True
                break
            if out:
                out_times.writing(out)
                await send({"type": "http.response.body", "body": out, "more_body": True})
                out_times.written()
        if exchange.disconnected:
            await response.aclose()
            self._disconnected(rid, t0, out_times.last)
            return
        if exchange.command is not None:
            await response.aclose()
            command = exchange.command
            final = final_chunk(
                chat=chat,
                choices=choices,
                finish_reason="cutoff",
                error=_cut_error(command),
                first_events=first_events,
                request_id=rid,
                model=model if isinstance(model, str) else None,
            )
            await send({"type": "http.response.body", "body": final, "more_body": False})
            self._cut(exchange, command, t0, response.status_code, out_times.last)
            return
        if ending is not None:
            await response.aclose()
            finish, error, outcome = ending
            final = final_chunk(
                chat=chat,
                choices=choices,
                finish_reason=finish,
                error=error,
                first_events=first_events,
                request_id=rid,
                model=model if isinstance(model, str) else None,
            )
            await send({"type": "http.response.body", "body": final, "more_body": False})
            self._finish(rid, t0, response.status_code, "error", outcome, out_times.last)
            return
        out_times.writing(tail)
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        out_times.written()
        self._finish(rid, t0, response.status_code, finish_reason, "completed", out_times.last)
        if done:  # let the upstream end its body, so its connection goes back to the pool
            with contextlib.suppress(httpx.HTTPError, TimeoutError):
                async with asyncio.timeout(_DRAIN_AFTER_DONE_S):
                    async for _ in chunks:
                        pass

    async def _relay_whole(
        self,
        exchange: _Exchange,
        response: httpx.Response,
        send: Send,
        stream: bool,
        chat: bool,
        choices: int,
        model: Any,
        t0: float,
    ) -> None:
        """Read a non-stream response whole (raw bytes), then relay it with its status and headers."""
        rid = exchange.request_id
        parts: list[bytes] = []
        exchange.interruptible = True
        try:
            async for chunk in _raw(response):
                parts.append(chunk)
        except asyncio.CancelledError:
            if not exchange.absorb_cancel():
                raise
            await response.aclose()
            await self._interrupted(exchange, send, stream, chat, choices, model, t0)
            return
        except httpx.HTTPError as exc:
            exchange.interruptible = False
            await self._upstream_failed(exchange, send, exc, t0)
            return
        exchange.interruptible = False
        if exchange.interrupted:  # interrupted after the last read, before we answered
            await self._interrupted(exchange, send, stream, chat, choices, model, t0)
            return
        body = b"".join(parts)
        encoded = response.headers.get("content-encoding", "identity") != "identity"
        out_times = _OutTimes(self, rid, t0)
        if not encoded and response.status_code < 300:
            out_times.writing(body)  # a whole response: its tokens reach the client at once
        await _send_all(
            send,
            response.status_code,
            _client_headers(response, self._request_id_header, rid, len(body)),
            body,
        )
        out_times.written()
        self._finish(
            rid,
            t0,
            response.status_code,
            None if encoded else last_finish_reason(body),
            "completed",
            out_times.last,
        )

    async def _interrupted(
        self,
        exchange: _Exchange,
        send: Send,
        stream: bool,
        chat: bool,
        choices: int,
        model: Any,
        t0: float,
    ) -> None:
        """A disconnect or a cut before any response byte reached the client."""
        rid = exchange.request_id
        if exchange.disconnected:
            self._disconnected(rid, t0)
            return
        command = exchange.command
        assert command is not None
        if stream:
            final = final_chunk(
                chat=chat,
                choices=choices,
                finish_reason="cutoff",
                error=_cut_error(command),
                first_events=None,
                request_id=rid,
                model=model if isinstance(model, str) else None,
            )
            headers = [
                (b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache"),
                (self._request_id_header, rid.encode()),
            ]
            await _send_all(send, 200, headers, final)
            self._cut(exchange, command, t0, 200)
        else:
            body = _encode({"error": _cut_error(command)})
            await _json(send, CUT_STATUS, body, rid, self._request_id_header)
            self._cut(exchange, command, t0, CUT_STATUS)

    async def _upstream_failed(
        self, exchange: _Exchange, send: Send, exc: httpx.HTTPError, t0: float
    ) -> None:
        rid = exchange.request_id
        upstream = self.config.upstream_base
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            self.metrics.upstream_errors["unreachable"].inc()
            status, kind, outcome = 502, "upstream_unreachable", "upstream_unreachable"
            message = f"cannot connect to the upstream {upstream} ({type(exc).__name__}: {exc})"
        elif isinstance(exc, httpx.TimeoutException):
            self.metrics.upstream_errors["timeout"].inc()
            status, kind, outcome = 504, "upstream_timeout", "upstream_timeout"
            message = f"the upstream {upstream} sent no response within {self.config.read_timeout_s:g} s"
        else:
            self.metrics.upstream_errors["broken"].inc()
            status, kind, outcome = 502, "upstream_error", "upstream_error"
            message = f"the upstream {upstream} broke the connection ({type(exc).__name__}: {exc})"
        self._finish(rid, t0, status, None, outcome)
        await _json(send, status, error_body(message, kind, status), rid, self._request_id_header)

    # -- events -----------------------------------------------------------------------------------

    def _finish(
        self,
        rid: str,
        t0: float,
        status: int,
        finish_reason: str | None,
        outcome: str,
        last_out: float | None = None,
    ) -> None:
        """``last_out``: monotonic time the last generated content was written to the client."""
        self.e_completed(
            rid, status, time.monotonic() - t0, finish_reason, None if last_out is None else last_out - t0
        )
        self.metrics.finished[outcome].inc()

    def _disconnected(self, rid: str, t0: float, last_out: float | None = None) -> None:
        self.e_disconnected(rid, time.monotonic() - t0, None if last_out is None else last_out - t0)
        self.metrics.finished["client_disconnected"].inc()

    def _cut(
        self, exchange: _Exchange, command: Command, t0: float, status: int, last_out: float | None = None
    ) -> None:
        rid = exchange.request_id
        self.e_cut(rid, command.rule, command.id)
        self.e_applied(rid, command.id, "abort", command.rule)
        self.metrics.commands_applied.inc()
        self._finish(rid, t0, status, "cutoff", "stream_cut", last_out)

    # -- other routes -----------------------------------------------------------------------------

    async def _relay_plain(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``/v1/models``: no admission, no events; status, headers and body as the upstream sent them."""
        client = self._client
        assert client is not None, "the gateway was not started (ASGI lifespan)"
        try:
            body = await _read_body(receive)
        except _Disconnected:
            return
        except BadRequest as exc:
            await _json(send, 413, error_body(str(exc), "invalid_request_error", 413))
            return
        url = self.config.upstream_base + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k not in _DROP_REQUEST]
        try:
            response = await client.request(scope["method"], url, headers=headers, content=body or None)
        except httpx.HTTPError as exc:
            status = (
                504
                if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)
                else 502
            )
            message = f"upstream {self.config.upstream_base} failed ({type(exc).__name__}: {exc})"
            await _json(send, status, error_body(message, "upstream_error", status))
            return
        raw = response.content
        headers_out = [
            (k.lower(), v)
            for k, v in response.headers.raw
            if k.lower() not in _DROP_RESPONSE | {b"content-encoding"}
        ]
        headers_out.append((b"content-length", str(len(raw)).encode()))
        await _send_all(send, response.status_code, headers_out, raw)


# -- helpers --------------------------------------------------------------------------------------


def _raw(response: httpx.Response) -> httpx.AsyncByteStream:
    """The transport's stream: the body as read, still content-encoded, a piece per socket read."""
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)
    return stream


class _Disconnected(Exception):
    pass


async def _read_body(receive: Receive) -> bytes:
    """The whole request body. Raises _Disconnected (the client left) or BadRequest (over 64 MiB)."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        if chunk:
            parts.append(chunk)
            size += len(chunk)
            if size > _MAX_BODY:
                raise BadRequest(f"the request body is larger than {_MAX_BODY >> 20} MiB")
        if not message.get("more_body", False):
            return b"".join(parts) if len(parts) != 1 else parts[0]


def _request_id(value: bytes, header: str) -> str:
    text = value.decode("latin-1")
    if not _REQUEST_ID_RE.match(text):
        raise BadRequest(
            f"header {header} must be 1-256 visible ASCII characters, got {text[:300]!r}", header
        )
    return text


def _priority(value: bytes | None, header: str) -> int:
    if value is None:
        return 0
    try:
        priority = int(value)
    except ValueError:
        raise BadRequest(
            f"header {header} must be an integer (lower runs first), got {value[:100]!r}", header
        ) from None
    if not -(2**31) <= priority < 2**31:
        raise BadRequest(f"header {header} must be a 32-bit integer, got {priority}", header)
    return priority


def _parse_body(body: bytes) -> tuple[dict[str, Any], bool, int]:
    """The JSON request object, whether it streams, and how many choices it asks for."""
    try:
        payload = _decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(payload).__name__}")
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be a boolean, got {stream!r}", "stream")
    choices = payload.get("n", 1)
    if choices is None:
        choices = 1
    if not isinstance(choices, int) or isinstance(choices, bool) or not 1 <= choices <= 128:
        raise BadRequest(f"n must be an integer from 1 to 128, got {choices!r}", "n")
    xargs = payload.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise BadRequest(f"vllm_xargs must be an object, got {type(xargs).__name__}", "vllm_xargs")
    return payload, stream, choices


def _upstream_headers(
    headers: list[tuple[bytes, bytes]], id_header: bytes, request_id: str, stream: bool
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop ones, plus the request id. A stream is asked for unencoded, so
    that the gateway can append its own final event; other bodies keep the client's accept-encoding."""
    out = []
    encoding = b"identity"
    for name, value in headers:
        if name in _DROP_REQUEST or name == id_header:
            if name == b"accept-encoding" and not stream:
                encoding = value
            continue
        out.append((name, value))
    out.append((b"accept-encoding", encoding))
    out.append((id_header, request_id.encode()))
    return out


def _client_headers(
    response: httpx.Response, id_header: bytes, request_id: str, length: int | None
) -> list[tuple[bytes, bytes]]:
    out = [
        (k.lower(), v)
        for k, v in response.headers.raw
        if k.lower() not in _DROP_RESPONSE and k.lower() != id_header
    ]
    out.append((id_header, request_id.encode()))
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    return out


def _cut_error(command: Command) -> dict[str, Any]:
    detail = f": {command.detail}" if command.detail else ""
    return error_object(
        f"the request was cut off by the chunkledger rule '{command.rule}'{detail}",
        "chunkledger_cutoff",
        command.rule,
    )


async def _send_all(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _json(
    send: Send,
    status: int,
    body: bytes,
    request_id: str | None = None,
    id_header: bytes = b"x-request-id",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if request_id is not None:
        headers.append((id_header, request_id.encode()))
    if extra:
        headers.extend(extra)
    await _send_all(send, status, headers, body)


def create_app(config: GatewayConfig, *, exporter_config: ExporterConfig | None = None) -> Gateway:
    return Gateway(config, exporter_config=exporter_config)
