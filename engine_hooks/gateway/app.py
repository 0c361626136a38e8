"""The gateway: an OpenAI-compatible streaming proxy with an admission queue, as a plain ASGI app.

Per generation request (``POST /v1/completions``, ``POST /v1/chat/completions``)::

    arrived ── read + parse body, assign the request id ── admission_enqueued (entry_s)
            ── wait for one of max_in_flight upstream slots ── admitted (wait_s)
            ── forward (httpx's pooled transport, upstream.py) ── first_byte ── relay ── completed

The request id is the client's ``X-Request-Id`` or a new one; it goes upstream in that header (vLLM's
OpenAI server uses it for its own request id) and in the body as
``vllm_xargs.chunkledger_request_id``, which vLLM copies into ``SamplingParams.extra_args`` where the
engine hook reads it, so gateway and engine rows of the ledger join. The request gets a span of the
gateway's in the client's W3C trace (its ``traceparent``, else a new trace: ``GatewaySpan``), sent
upstream as the engine's parent and to the ledger on ``arrived``. Durations in events are measured
with the monotonic clock; ``ts`` is the wall clock.

This module holds the ASGI entry, the routes, admission and the life cycle; a request's context
travels in its :class:`~engine_hooks.gateway.exchange.Exchange`, the client's request is read and
checked by request.py, and the upstream's answer reaches the client through relay.py.

Interruptions: a cutoff command from the ledger (``on_command``, on the exporter's thread, handed to
the event loop) or a client disconnect (a watcher task on ``receive()``) marks the request's exchange
and cancels its task only while it awaits the upstream or the queue, never in the middle of a write
to the client. The handler then ends the stream with a final chunk naming the rule and ``[DONE]`` (a
cut), or an error response (a cut before any byte was sent, non-streaming), and closes the upstream
response, which closes its connection: vLLM aborts a request whose client went away.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine_hooks.config import ExporterConfig
from engine_hooks.events import (
    XARGS_KEY,
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
from engine_hooks.gateway.exchange import Exchange, GatewaySpan, Receive, Scope, Send
from engine_hooks.gateway.metrics import GatewayMetrics
from engine_hooks.gateway.relay import (
    OutTimes,
    answer_interrupted,
    await_upstream,
    relay_plain,
    relay_stream,
    relay_whole,
)
from engine_hooks.gateway.request import (
    BadRequest,
    BodyTimeout,
    Disconnected,
    parse_body,
    parse_priority,
    parse_request_id,
    read_body,
    upstream_headers,
)
from engine_hooks.gateway.responses import error_body, send_all, send_json
from engine_hooks.gateway.upstream import upstream_transport

log = logging.getLogger(__name__)

_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
# vLLM's OpenAI server's other routes that clients and benchmark tools probe (GuideLLM: GET /health),
# relayed as they are, without admission or events, so the gateway answers them as vLLM does
# (vllm/entrypoints/serve/instrumentator/, .../tokenize/, .../sagemaker/, .../openai/models/).
VLLM_ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET",),
    "/ping": ("GET", "POST"),
    "/version": ("GET",),
    "/load": ("GET",),
    "/v1/models": ("GET",),
    "/tokenize": ("POST",),
    "/detokenize": ("POST",),
}
_encode = msgspec.json.encode
_OutTimes = OutTimes  # the name the tests know it by


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
        self.id_header = config.request_id_header.lower().encode()  # in both directions
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._pool: httpx.AsyncBaseTransport | None = None
        self._timeouts: dict[str, float | None] = {}
        self._urls: dict[str, httpx.URL] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._active: dict[str, Exchange] = {}
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
        self.e_arrived = e(
            Arrived,
            "ts",
            "request_id",
            "endpoint",
            "stream",
            "priority",
            "trace_id",
            "parent_span_id",
            "span_id",
        )
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
                await send_json(send, 405, error_body(f"{path} takes POST", "invalid_request_error", 405))
                return
            self.metrics.requests[endpoint].inc()
            await self._generate(Exchange(scope, receive, send, endpoint == "chat_completions"))
        elif path in VLLM_ROUTES:
            await self._relay_vllm_route(path, method, scope, receive, send)
        elif path == "/metrics":
            await send_all(
                send, 200, [(b"content-type", CONTENT_TYPE_LATEST.encode())], generate_latest(self.registry)
            )
        elif path == "/healthz":
            await send_json(send, 200, b'{"status":"ok"}')
        else:
            await send_json(
                send,
                404,
                error_body(f"no route {method} {path} in the chunkledger gateway", "not_found_error", 404),
            )

    async def _relay_vllm_route(
        self, path: str, method: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """One of vLLM's own routes: relayed whole. ``GET /health`` is the engine's health (vLLM answers
        200 or 503 with an empty body); an upstream the gateway cannot reach is unhealthy too (503)."""
        methods = VLLM_ROUTES[path]
        if method not in methods:
            message = f"{path} takes {' or '.join(methods)}"
            await send_json(
                send,
                405,
                error_body(message, "invalid_request_error", 405),
                extra=[(b"allow", ", ".join(methods).encode())],
            )
            return
        self.metrics.requests["models" if path == "/v1/models" else "vllm_routes"].inc()
        assert self._client is not None, "the gateway was not started (ASGI lifespan)"
        unreachable = 503 if path == "/health" else None
        await relay_plain(self._client, self.config.upstream_base, scope, receive, send, unreachable)

    # -- generation requests ----------------------------------------------------------------------

    async def _generate(self, x: Exchange) -> None:
        client_id = priority_raw = traceparent = tracestate = None
        for name, value in x.scope["headers"]:
            if name == self.id_header:
                client_id = value
            elif name == self._priority_header:
                priority_raw = value
            elif name == b"traceparent":
                traceparent = value
            elif name == b"tracestate":
                tracestate = value
        x.trace = GatewaySpan(traceparent, tracestate)
        try:
            body = await read_body(x.receive, self.config.body_timeout_s)
        except Disconnected:
            return
        except BodyTimeout:
            message = (
                f"the request body was not complete within {self.config.body_timeout_s:g} s (body_timeout_s)"
            )
            body = error_body(message, "invalid_request_error", 408)
            await send_json(x.send, 408, body, x.request_id, self.id_header, [(b"connection", b"close")])
            return
        except BadRequest as exc:
            body = error_body(str(exc), "invalid_request_error", 413)
            await send_json(x.send, 413, body, x.request_id, self.id_header)
            return
        try:
            if client_id is not None:
                x.request_id = parse_request_id(client_id, self.config.request_id_header)
            x.priority = parse_priority(priority_raw, self.config.priority_header)
            payload, x.stream, x.choices = parse_body(body)
        except BadRequest as exc:
            self.e_arrived(x.ts0, x.request_id, x.path, False, 0, *self._trace_fields(x))
            self.report_completed(x, 400, None, "bad_request")
            body = error_body(str(exc), "invalid_request_error", 400, exc.param)
            await send_json(x.send, 400, body, x.request_id, self.id_header)
            return
        if x.request_id in self._active:
            # Two requests under one id would merge into one row at the ledger (and a cutoff for one
            # would cut the other): the second is refused while the first is in flight. No event is
            # sent for it, so nothing of it reaches the first one's row.
            self.metrics.finished["duplicate_request_id"].inc()
            body = error_body(
                f"header {self.config.request_id_header}: request id {x.request_id!r} is in flight here "
                "already; send each request with an id of its own",
                "invalid_request_error",
                409,
                self.config.request_id_header,
            )
            await send_json(x.send, 409, body, x.request_id, self.id_header)
            return
        model = payload.get("model")
        x.model = model if isinstance(model, str) else None
        xargs = payload.get("vllm_xargs")
        payload["vllm_xargs"] = {**(xargs or {}), XARGS_KEY: x.request_id}
        x.body = _encode(payload)
        self.e_arrived(x.ts0, x.request_id, x.path, x.stream, x.priority, *self._trace_fields(x))
        self.e_enqueued(x.request_id, self.queue.depth, time.monotonic() - x.t0)

        request_id = x.request_id
        self._active[request_id] = x
        watcher = asyncio.ensure_future(self._watch(x))
        try:
            await self._admit_and_forward(x)
        finally:
            x.done = True
            watcher.cancel()
            if self._active.get(request_id) is x:
                del self._active[request_id]

    @staticmethod
    def _trace_fields(x: Exchange) -> tuple[str | None, str | None, str | None]:
        """``arrived``'s trace fields: the trace, the client's span, the gateway's span."""
        trace = x.trace
        if trace is None:
            return None, None, None
        return trace.trace_id, trace.parent_span_id, trace.span_id

    async def _watch(self, x: Exchange) -> None:
        """Wait for the client to go away (``http.disconnect``) and interrupt the exchange."""
        while not x.done:
            message = await x.receive()
            if message["type"] == "http.disconnect":
                if not x.done:
                    x.disconnected = True
                    x.interrupt()
                return

    async def _admit_and_forward(self, x: Exchange) -> None:
        x.interruptible = True
        try:
            wait_s = await self.queue.acquire(x.priority)
        except AdmissionRefused as exc:
            x.interruptible = False
            self.report_completed(x, exc.status, None, f"rejected_{exc.reason}")
            kind = "rate_limit_error" if exc.status == 429 else "service_unavailable"
            await send_json(
                x.send,
                exc.status,
                error_body(str(exc), kind, exc.status),
                x.request_id,
                self.id_header,
                extra=[(b"retry-after", self._retry_after)],
            )
            return
        except asyncio.CancelledError:
            if not x.absorb_cancel():
                raise
            await answer_interrupted(self, x)
            return
        x.interruptible = False
        self.metrics.admission_wait.observe(wait_s)
        self.e_admitted(x.request_id, wait_s, self.queue.in_flight)
        try:
            await self._forward(x)
        finally:
            self.queue.release()

    async def _forward(self, x: Exchange) -> None:
        pool = self._pool
        assert pool is not None, "the gateway was not started (ASGI lifespan)"
        scope = x.scope
        url = self._urls[x.path]
        request = httpx.Request(
            "POST",
            url.copy_with(query=query) if (query := scope.get("query_string")) else url,
            headers=upstream_headers(
                scope["headers"],
                self.id_header,
                x.request_id,
                x.stream,
                x.trace.upstream_headers() if x.trace is not None else [],
            ),
            content=x.body,
            extensions={"timeout": self._timeouts},
        )
        self.metrics.upstream_requests.inc()
        response = await await_upstream(self, x, pool.handle_async_request(request))
        if response is None:
            return
        x.response = response
        try:
            since = time.monotonic() - x.t0
            self.e_first_byte(x.request_id, since)
            self.metrics.first_byte.observe(since)
            if response.status_code >= 500:
                self.metrics.upstream_errors["status_5xx"].inc()
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                await relay_stream(self, x)
            else:
                await relay_whole(self, x)
        finally:
            await response.aclose()  # mid-stream: closes the connection, so the upstream aborts

    # -- events -----------------------------------------------------------------------------------

    def report_completed(
        self, x: Exchange, status: int, finish_reason: str | None, outcome: str, last_out: float | None = None
    ) -> None:
        """``last_out``: monotonic time the last generated content was written to the client."""
        t0 = x.t0
        self.e_completed(
            x.request_id,
            status,
            time.monotonic() - t0,
            finish_reason,
            None if last_out is None else last_out - t0,
        )
        self.metrics.finished[outcome].inc()

    def report_disconnected(self, x: Exchange, last_out: float | None = None) -> None:
        t0 = x.t0
        self.e_disconnected(x.request_id, time.monotonic() - t0, None if last_out is None else last_out - t0)
        self.metrics.finished["client_disconnected"].inc()

    def report_cut(self, x: Exchange, status: int, last_out: float | None = None) -> None:
        """The exchange's cutoff command was applied: the stream or the response ended with its rule."""
        command = x.command
        assert command is not None
        self.e_cut(x.request_id, command.rule, command.id)
        self.e_applied(x.request_id, command.id, "abort", command.rule)
        self.metrics.commands_applied.inc()
        self.report_completed(x, status, "cutoff", "stream_cut", last_out)


def create_app(config: GatewayConfig, *, exporter_config: ExporterConfig | None = None) -> Gateway:
    return Gateway(config, exporter_config=exporter_config)
