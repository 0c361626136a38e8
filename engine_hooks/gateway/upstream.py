"""The gateway's connections to an ``http://`` upstream: httpx's transport and httpcore's pool, with an
HTTP/1.1 connection that parses responses with httptools.

httpx and httpcore keep what they are good at: the pool (limits, keep-alive expiry, queueing for a
connection), the request and response types, timeouts and the exception types the gateway handles.
Each pooled connection is :class:`Http1Connection`, which replaces httpcore's h11-based one (pure
Python, a state machine step per chunk of a chunked body) with llhttp through httptools (C, the parser
uvicorn uses on the other side of the gateway):

* the request goes out in one write: head and body;
* a response body is yielded per socket read: every body byte that read brought, chunked framing
  removed. A stream's events that the upstream wrote back to back and that arrived together reach the
  gateway (and so its client) as one piece instead of one piece per event; bytes are never held back
  waiting for more.

HTTP/1.1 only, one request at a time per connection, bodies framed by Content-Length, chunked
encoding or the end of the connection. A connection is reused only after its response was read to the
end and the upstream allows keep-alive; a response closed early closes its connection (that is how
the upstream learns that the client went away).
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterable, AsyncIterator

import httpcore
import httptools
import httpx

from engine_hooks.gateway.network import AsyncioBackend

_READ_BYTES = 1 << 16
# Response extension: a function telling whether the whole body has been read from the upstream (after
# the last piece, before the iterator says so), so a relay can end its own response with that piece.
BODY_COMPLETE = "chunkledger.body_complete"


class _State(enum.Enum):
    NEW = "NEW"  # created for a request, not connected yet
    ACTIVE = "ACTIVE"  # a request is using it
    IDLE = "IDLE"  # kept alive for the next request
    CLOSED = "CLOSED"


class _Response:
    """httptools parser callbacks: one response's status, headers and body pieces.

    A 1xx answer (100 Continue) has no body in HTTP/1.1 and is not the response: it is skipped."""

    __slots__ = ("body", "complete", "eof", "extra", "headers", "headers_done", "keep_alive", "parser")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.body: list[bytes] = []
        self.complete = False
        self.eof = False  # the body ended with the connection (or HEAD): the connection is done
        self.extra = False  # the upstream began another answer after this one: do not reuse
        self.keep_alive = False  # the upstream keeps the connection open after this answer

    def on_message_begin(self) -> None:
        if self.complete:
            self.extra = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() < 200:
            self.headers.clear()
        else:
            self.headers_done = True

    def on_body(self, body: bytes) -> None:
        if body:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback

    def is_complete(self) -> bool:
        return self.complete

    def take_body(self) -> bytes:
        """The body bytes parsed since the last call, as one piece."""
        body = self.body
        if not body:
            return b""
        piece = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        return piece

    def ends_with_connection(self) -> bool:
        """No Content-Length and not chunked: the body is whatever comes until the upstream closes."""
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True

    @property
    def reusable(self) -> bool:
        """The connection may carry another request: read to the end, and the upstream keeps it open."""
        return self.complete and self.keep_alive and not self.eof and not self.extra


def _request_head(request: httpcore.Request) -> bytes:
    """The request line and headers; refuses a header that would split the head (CR or LF in it)."""
    headers = request.headers
    head = b"".join(
        [
            request.method,
            b" ",
            request.url.target,
            b" HTTP/1.1\r\n",
            *[b"%s: %s\r\n" % (name, value) for name, value in headers],
            b"\r\n",
        ]
    )
    lines = len(headers) + 2
    if head.count(b"\n") != lines or head.count(b"\r") != lines:
        raise httpcore.LocalProtocolError("CR or LF in a request header name or value")
    return head


class Http1Connection(httpcore.AsyncConnectionInterface):
    """One keep-alive HTTP/1.1 connection to the upstream, used by one request at a time."""

    def __init__(
        self, origin: httpcore.Origin, backend: httpcore.AsyncNetworkBackend, keepalive_expiry: float | None
    ):
        self._origin = origin
        self._backend = backend
        self._keepalive_expiry = keepalive_expiry
        self._stream: httpcore.AsyncNetworkStream | None = None
        self._state = _State.NEW
        self._expire_at: float | None = None
        self._requests = 0

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        if not self.can_handle_request(request.url.origin):
            raise RuntimeError(f"the connection to {self._origin} cannot send to {request.url.origin}")
        if self._state not in (_State.NEW, _State.IDLE):
            raise httpcore.ConnectionNotAvailable()
        self._state = _State.ACTIVE
        self._expire_at = None
        self._requests += 1
        timeouts = request.extensions.get("timeout", {})
        try:
            if self._stream is None:
                host = self._origin.host.decode("ascii")
                self._stream = await self._backend.connect_tcp(
                    host, self._origin.port, timeout=timeouts.get("connect")
                )
            await self._send(request, timeouts.get("write"))
            response = _Response()
            read_timeout = timeouts.get("read")
            while not response.headers_done:
                await self._receive(response, read_timeout)
            if request.method == b"HEAD":  # no body follows; the parser cannot know: do not reuse
                response.complete = response.eof = True
        except BaseException:
            await self.aclose()
            raise
        return httpcore.Response(
            status=response.parser.get_status_code(),
            headers=response.headers,
            content=_Body(self, response, read_timeout),
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": b"",
                "network_stream": self._stream,
                BODY_COMPLETE: response.is_complete,
            },
        )

    async def _send(self, request: httpcore.Request, timeout: float | None) -> None:
        assert self._stream is not None
        parts = [_request_head(request)]
        chunked = any(
            name.lower() == b"transfer-encoding" and value.lower() == b"chunked"
            for name, value in request.headers
        )
        stream = request.stream
        assert isinstance(stream, AsyncIterable), "an async transport sends async request bodies"
        async for part in stream:
            if part:
                parts.append(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
        if chunked:
            parts.append(b"0\r\n\r\n")
        await self._stream.write(b"".join(parts), timeout)

    async def _receive(self, response: _Response, timeout: float | None) -> None:
        """One socket read, fed to the parser."""
        assert self._stream is not None
        data = await self._stream.read(_READ_BYTES, timeout)
        if not data:
            if response.headers_done and response.ends_with_connection():
                response.complete = response.eof = True
                return
            raise httpcore.RemoteProtocolError(
                "the upstream closed the connection before the end of its response"
                if response.headers_done
                else "the upstream closed the connection without sending a response"
            )
        try:
            response.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise httpcore.RemoteProtocolError("the upstream switched protocols") from None
        except httptools.HttpParserError as exc:
            raise httpcore.RemoteProtocolError(f"malformed response from the upstream: {exc}") from None

    async def _body(self, response: _Response, timeout: float | None) -> AsyncIterator[bytes]:
        piece = response.take_body()  # what came with the headers
        if piece:
            yield piece
        while not response.complete:
            await self._receive(response, timeout)
            piece = response.take_body()
            if piece:
                yield piece

    async def _response_closed(self, response: _Response) -> None:
        if self._state is _State.ACTIVE and response.reusable:
            self._state = _State.IDLE
            if self._keepalive_expiry is not None:
                self._expire_at = time.monotonic() + self._keepalive_expiry
        else:
            await self.aclose()

    async def aclose(self) -> None:
        self._state = _State.CLOSED
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()

    def can_handle_request(self, origin: httpcore.Origin) -> bool:
        return origin == self._origin

    def is_available(self) -> bool:
        return self._state is _State.IDLE

    def has_expired(self) -> bool:
        if self._state is not _State.IDLE:
            return False
        if self._expire_at is not None and time.monotonic() > self._expire_at:
            return True
        # An idle connection with something to read: the upstream closed it (or broke the protocol).
        return self._stream is None or bool(self._stream.get_extra_info("is_readable"))

    def is_idle(self) -> bool:
        return self._state is _State.IDLE

    def is_closed(self) -> bool:
        return self._state is _State.CLOSED

    def info(self) -> str:
        return f"HTTP/1.1, {self._state.value}, Request Count: {self._requests}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} [{self._origin}, {self.info()}]>"


class _Body:
    """A response body as httpcore's pool wraps it: async iterable of byte pieces, plus ``aclose``."""

    def __init__(self, connection: Http1Connection, response: _Response, timeout: float | None):
        self._connection = connection
        self._response = response
        self._timeout = timeout
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self._connection._body(self._response, self._timeout):
                yield piece
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._connection._response_closed(self._response)


class UpstreamPool(httpcore.AsyncConnectionPool):
    """httpcore's pool whose connections are :class:`Http1Connection` over the asyncio backend."""

    def create_connection(self, origin: httpcore.Origin) -> httpcore.AsyncConnectionInterface:
        return Http1Connection(origin, self._network_backend, self._keepalive_expiry)


def upstream_transport(upstream: str, limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    """httpx's pooled transport to the upstream; for ``http://`` its pool is :class:`UpstreamPool`
    (``https://`` keeps httpx's own connections)."""
    transport = httpx.AsyncHTTPTransport(limits=limits, trust_env=False)
    if upstream.startswith("http://") and hasattr(transport, "_pool"):
        transport._pool = UpstreamPool(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=AsyncioBackend(),
        )
    return transport
