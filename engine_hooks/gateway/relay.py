"""What reaches the client of a generation request once the upstream answered, or instead of its answer.

Streams (``text/event-stream``) are relayed as the upstream's bytes arrive, unchanged, one write to
the client per socket read from the upstream (events that arrived together go out together); only a
partial SSE event at the end of a read is held until its blank line arrives, so the gateway can always
end a stream on an event boundary. Other responses are read whole and relayed with their status,
headers and raw (still encoded) body.

The gateway ends a stream itself (:func:`end_stream`: a final chunk naming why, then ``[DONE]``) on a
cut, a read timeout or a broken upstream; a cut or a disconnect before any byte was sent gets its own
answer (:func:`answer_interrupted`), and an upstream that could not answer an error response
(:func:`answer_upstream_failed`); waits on the upstream that a cut or a disconnect may interrupt go
through :func:`await_upstream`. The clock for the client's first and last token is read just before
the write that carries it (:class:`OutTimes`). ``/v1/models`` is relayed whole (:func:`relay_plain`).
What the relay needs of the gateway (its settings and metrics, where an exchange's end is reported) is
:class:`Host`, so this module does not import the gateway's app, which imports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

import httpx
import msgspec

from engine_hooks.gateway.config import GatewayConfig
from engine_hooks.gateway.exchange import Exchange, Receive, Scope, Send
from engine_hooks.gateway.metrics import GatewayMetrics
from engine_hooks.gateway.request import DROP_REQUEST, HOP_BY_HOP, BadRequest, Disconnected, read_body
from engine_hooks.gateway.responses import (
    ErrorBody,
    OpenAIError,
    cut_error,
    ends_stream,
    error_body,
    event_boundary,
    final_chunk,
    has_choice,
    last_finish_reason,
    send_all,
    send_json,
)
from engine_hooks.gateway.upstream import BODY_COMPLETE

CUT_STATUS = 400  # non-streaming answer to a cut: a 4xx that OpenAI clients do not retry
DROP_RESPONSE = HOP_BY_HOP | {b"content-length"}
# After relaying [DONE], how long the upstream may take to end its body before its connection is
# closed instead of going back to the pool.
_DRAIN_AFTER_DONE_S = 1.0
_encode = msgspec.json.encode
T = TypeVar("T")


class Host(Protocol):
    """The gateway a relay runs in (:class:`engine_hooks.gateway.app.Gateway`), as the relay uses it."""

    config: GatewayConfig
    metrics: GatewayMetrics
    id_header: bytes  # the request id header's name, lower case
    e_first_token_out: Callable[[float, str, float], None]  # (ts, request_id, since_arrived_s)

    def report_completed(
        self, x: Exchange, status: int, finish_reason: str | None, outcome: str, last_out: float | None = None
    ) -> None: ...
    def report_disconnected(self, x: Exchange, last_out: float | None = None) -> None: ...
    def report_cut(self, x: Exchange, status: int, last_out: float | None = None) -> None: ...


class OutTimes:
    """When the generated content of one response was written to the client: the first write (the
    client's time to first token; a ``first_token_out`` event and the TTFT histogram) and the last.

    The clock is read just before the write (:meth:`writing`), the event and the histogram follow it
    (:meth:`written`): a client cannot read content before it was written, and a stamp read after
    ``send`` returned could come tens of ms after the client's read on a busy host."""

    __slots__ = ("at", "at_wall", "first", "gateway", "last", "request_id", "t0")

    def __init__(self, gateway: Host, request_id: str, t0: float):
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


class Ending(NamedTuple):
    """How the gateway ends a stream it does not relay to its end: the finish reason of every choice,
    the error of its last event, and the exchange's outcome."""

    finish_reason: str  # "cutoff" or "error"
    error: OpenAIError
    outcome: str  # "stream_cut", "upstream_timeout" or "upstream_error"


@dataclass
class _Relayed:
    """What relaying a stream's pieces left: the piece not yet written (the stream's last), the first
    events written, the last finish reason seen, why the upstream failed, whether [DONE] came."""

    tail: bytes = b""
    first_events: bytes | None = None
    finish_reason: str | None = None
    ending: Ending | None = None
    done: bool = False


async def relay_stream(gw: Host, x: Exchange) -> None:
    """Relay an SSE stream chunk by chunk; end it ourselves on a cut, a timeout or a broken upstream."""
    response = x.response
    assert response is not None
    status = response.status_code
    await x.send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": client_headers(response, gw.id_header, x.request_id, None),
        }
    )
    x.started = True
    chunks = aiter(raw(response))
    times = OutTimes(gw, x.request_id, x.t0)
    got = await _relay_pieces(gw, x, response, chunks, times)
    if x.disconnected:
        await response.aclose()
        gw.report_disconnected(x, times.last)
        return
    command = x.command
    ending = Ending("cutoff", cut_error(command), "stream_cut") if command is not None else got.ending
    if ending is not None:
        await response.aclose()
        finish, error, outcome = ending
        await end_stream(gw, x, finish, error, got.first_events)
        if command is not None:
            gw.report_cut(x, status, times.last)
        else:
            gw.report_completed(x, status, finish, outcome, times.last)
        return
    times.writing(got.tail)
    await x.send({"type": "http.response.body", "body": got.tail, "more_body": False})
    times.written()
    gw.report_completed(x, status, got.finish_reason, "completed", times.last)
    if got.done:  # let the upstream end its body, so its connection goes back to the pool
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            async with asyncio.timeout(_DRAIN_AFTER_DONE_S):
                async for _ in chunks:
                    pass


async def _relay_pieces(
    gw: Host, x: Exchange, response: httpx.Response, chunks: AsyncIterator[bytes], times: OutTimes
) -> _Relayed:
    """Write the upstream's complete SSE events as they come, until its end, [DONE], an interrupt or
    a failure; the last piece is left for the caller to write with the end of the stream."""
    body_complete = response.extensions.get(BODY_COMPLETE)  # our transport for http:// upstreams
    got = _Relayed()
    while not x.interrupted:
        chunk, got.ending = await _next_piece(gw, x, chunks)
        if chunk is None:
            break
        data = got.tail + chunk if got.tail else chunk
        cut = event_boundary(data)
        out, got.tail = data[:cut], data[cut:]
        if out:
            if got.first_events is None:
                got.first_events = out
            reason = last_finish_reason(out)
            if reason is not None:
                got.finish_reason = reason
        if body_complete is not None and body_complete():
            # The upstream's body ended with this piece: it goes out with the end of the stream,
            # in one write. The iterator has nothing left (no read), so it is run to its end.
            with contextlib.suppress(StopAsyncIteration):
                await chunks.__anext__()
            got.tail = data
            break
        if out and ends_stream(out) and not got.tail:
            # [DONE]: the client has it all once this piece is written; its closing the connection
            # now is no disconnect. The upstream's end of body is awaited after the response.
            got.tail, got.done = out, True
            break
        if out:
            times.writing(out)
            await x.send({"type": "http.response.body", "body": out, "more_body": True})
            times.written()
    return got


async def _next_piece(
    gw: Host, x: Exchange, chunks: AsyncIterator[bytes]
) -> tuple[bytes | None, Ending | None]:
    """The upstream's next piece, interruptible while awaited; None at the end of its body, on an
    interrupt, or when it failed (then with the ending the client gets)."""
    x.interruptible = True
    try:
        chunk = await chunks.__anext__()
    except StopAsyncIteration:
        x.interruptible = False
        return None, None
    except asyncio.CancelledError:
        if not x.absorb_cancel():
            raise
        return None, None
    except httpx.TimeoutException:
        x.interruptible = False
        gw.metrics.upstream_errors["timeout"].inc()
        message = (
            f"the upstream sent nothing for {gw.config.read_timeout_s:g} s (read timeout); "
            "the gateway ended the stream"
        )
        error = OpenAIError(message=message, type="upstream_timeout", code=504)
        return None, Ending("error", error, "upstream_timeout")
    except httpx.HTTPError as exc:
        x.interruptible = False
        gw.metrics.upstream_errors["broken"].inc()
        message = f"the upstream connection broke mid-stream ({type(exc).__name__})"
        return None, Ending(
            "error", OpenAIError(message=message, type="upstream_error", code=502), "upstream_error"
        )
    x.interruptible = False
    return chunk, None


async def relay_whole(gw: Host, x: Exchange) -> None:
    """Read a non-stream response whole (raw bytes), then relay it with its status and headers."""
    response = x.response
    assert response is not None
    parts = await await_upstream(gw, x, _read_all(raw(response)))
    if parts is None:
        return
    if x.interrupted:  # interrupted after the last read, before we answered
        await answer_interrupted(gw, x)
        return
    body = b"".join(parts)
    status = response.status_code
    encoded = response.headers.get("content-encoding", "identity") != "identity"
    times = OutTimes(gw, x.request_id, x.t0)
    if not encoded and status < 300:
        times.writing(body)  # a whole response: its tokens reach the client at once
    x.started = True
    await send_all(x.send, status, client_headers(response, gw.id_header, x.request_id, len(body)), body)
    times.written()
    gw.report_completed(x, status, None if encoded else last_finish_reason(body), "completed", times.last)


async def await_upstream(gw: Host, x: Exchange, pending: Awaitable[T]) -> T | None:
    """Await the upstream (its response head, a whole body), interruptible: its result, or None when the
    exchange was answered instead (a cut or a disconnect meanwhile, or an upstream that failed)."""
    x.interruptible = True
    try:
        result = await pending
    except asyncio.CancelledError:
        if not x.absorb_cancel():
            raise
        if x.response is not None:
            await x.response.aclose()
        await answer_interrupted(gw, x)
        return None
    except httpx.HTTPError as exc:
        x.interruptible = False
        await answer_upstream_failed(gw, x, exc)
        return None
    x.interruptible = False
    return result


async def _read_all(stream: httpx.AsyncByteStream) -> list[bytes]:
    return [chunk async for chunk in stream]


async def end_stream(
    gw: Host, x: Exchange, finish_reason: str, error: OpenAIError, first_events: bytes | None = None
) -> None:
    """End a stream with the gateway's own last event (every choice finished with ``finish_reason``,
    plus ``error``; ``id``, ``model`` and ``created`` as in ``first_events``, the stream's first events
    when any were relayed) and ``[DONE]``. Before anything was sent, the head of a 200 stream goes first."""
    final = final_chunk(
        chat=x.chat,
        choices=x.choices,
        finish_reason=finish_reason,
        error=error,
        first_events=first_events,
        request_id=x.request_id,
        model=x.model,
    )
    if x.started:
        await x.send({"type": "http.response.body", "body": final, "more_body": False})
        return
    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"cache-control", b"no-cache"),
        (gw.id_header, x.request_id.encode()),
    ]
    x.started = True
    await send_all(x.send, 200, headers, final)


async def answer_interrupted(gw: Host, x: Exchange) -> None:
    """A disconnect or a cut before any response byte reached the client."""
    if x.disconnected:
        gw.report_disconnected(x)
        return
    command = x.command
    assert command is not None
    if x.stream:
        await end_stream(gw, x, "cutoff", cut_error(command))
        gw.report_cut(x, 200)
    else:
        body = _encode(ErrorBody(cut_error(command)))
        await send_json(x.send, CUT_STATUS, body, x.request_id, gw.id_header)
        gw.report_cut(x, CUT_STATUS)


async def answer_upstream_failed(gw: Host, x: Exchange, exc: httpx.HTTPError) -> None:
    """The upstream could not be reached, sent no response in time, or broke the connection."""
    upstream = gw.config.upstream_base
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        gw.metrics.upstream_errors["unreachable"].inc()
        status, kind, outcome = 502, "upstream_unreachable", "upstream_unreachable"
        message = f"cannot connect to the upstream {upstream} ({type(exc).__name__}: {exc})"
    elif isinstance(exc, httpx.TimeoutException):
        gw.metrics.upstream_errors["timeout"].inc()
        status, kind, outcome = 504, "upstream_timeout", "upstream_timeout"
        message = f"the upstream {upstream} sent no response within {gw.config.read_timeout_s:g} s"
    else:
        gw.metrics.upstream_errors["broken"].inc()
        status, kind, outcome = 502, "upstream_error", "upstream_error"
        message = f"the upstream {upstream} broke the connection ({type(exc).__name__}: {exc})"
    gw.report_completed(x, status, None, outcome)
    await send_json(x.send, status, error_body(message, kind, status), x.request_id, gw.id_header)


async def relay_plain(
    client: httpx.AsyncClient,
    upstream: str,
    scope: Scope,
    receive: Receive,
    send: Send,
    unreachable: int | None = None,
) -> None:
    """vLLM's other routes (``/v1/models``, ``/health``, ...): no admission, no events; status, headers
    and body as the upstream sent them. ``unreachable``: the status, with an empty body, for an upstream
    that did not answer (default: 502, or 504 for a timeout, with an error body)."""
    try:
        body = await read_body(receive)
    except Disconnected:
        return
    except BadRequest as exc:
        await send_json(send, 413, error_body(str(exc), "invalid_request_error", 413))
        return
    url = upstream + scope["path"]
    if scope.get("query_string"):
        url += "?" + scope["query_string"].decode("latin-1")
    headers = [(k, v) for k, v in scope["headers"] if k not in DROP_REQUEST]
    try:
        response = await client.request(scope["method"], url, headers=headers, content=body or None)
    except httpx.HTTPError as exc:
        if unreachable is not None:
            await send_all(send, unreachable, [(b"content-length", b"0")], b"")
            return
        status = (
            504
            if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)
            else 502
        )
        message = f"upstream {upstream} failed ({type(exc).__name__}: {exc})"
        await send_json(send, status, error_body(message, "upstream_error", status))
        return
    content = response.content
    headers_out = [
        (k.lower(), v)
        for k, v in response.headers.raw
        if k.lower() not in DROP_RESPONSE | {b"content-encoding"}
    ]
    headers_out.append((b"content-length", str(len(content)).encode()))
    await send_all(send, response.status_code, headers_out, content)


def raw(response: httpx.Response) -> httpx.AsyncByteStream:
    """The transport's stream: the body as read, still content-encoded, a piece per socket read."""
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)
    return stream


def client_headers(
    response: httpx.Response, id_header: bytes, request_id: str, length: int | None
) -> list[tuple[bytes, bytes]]:
    """The upstream's response headers minus hop-by-hop ones, with the gateway's request id."""
    out = [
        (k.lower(), v)
        for k, v in response.headers.raw
        if k.lower() not in DROP_RESPONSE and k.lower() != id_header
    ]
    out.append((id_header, request_id.encode()))
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    return out
