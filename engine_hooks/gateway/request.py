"""The client's request as the gateway reads it: the body (at most 64 MiB), the request id and priority
headers, the JSON fields the gateway acts on, and the headers that go upstream with it."""

from __future__ import annotations

import asyncio
import re
import time
from typing import TypedDict, cast

import msgspec

from engine_hooks.gateway.exchange import Receive

HOP_BY_HOP = frozenset(
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
DROP_REQUEST = HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding"}
# Visible ASCII but '/' (fits a header and the contract, and the ledger reads it back as one path
# segment of /v1/requests/{id}); "." and ".." are refused too.
_REQUEST_ID_RE = re.compile(r"^[\x21-\x2e\x30-\x7e]{1,256}$")
_MAX_BODY = 64 << 20
_decode = msgspec.json.decode


class CompletionRequest(TypedDict, total=False):
    """The fields of a client's JSON request object the gateway reads (:func:`parse_body` checks the
    types of ``stream``, ``n`` and ``vllm_xargs``); every other field goes upstream unread."""

    model: object  # the served model's name when a string; not checked (the upstream answers for it)
    stream: bool | None
    n: int | None
    vllm_xargs: dict[str, object] | None  # the gateway adds its request id here


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class Disconnected(Exception):
    """The client went away before its request body was read."""


class BodyTimeout(Exception):
    """The request body was not complete within the gateway's body_timeout_s."""


async def read_body(receive: Receive, timeout_s: float | None = None) -> bytes:
    """The whole request body. Raises Disconnected (the client left), BadRequest (over 64 MiB) or
    BodyTimeout (not complete within ``timeout_s``: a trickle or a Content-Length larger than the body)."""
    parts: list[bytes] = []
    size = 0
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        if deadline is None:
            message = await receive()
        else:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                raise BodyTimeout from None
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        if chunk:
            parts.append(chunk)
            size += len(chunk)
            if size > _MAX_BODY:
                raise BadRequest(f"the request body is larger than {_MAX_BODY >> 20} MiB")
        if not message.get("more_body", False):
            return b"".join(parts) if len(parts) != 1 else parts[0]


def parse_request_id(value: bytes, header: str) -> str:
    text = value.decode("latin-1")
    if not _REQUEST_ID_RE.match(text) or text in (".", ".."):
        raise BadRequest(
            f"header {header} must be 1-256 visible ASCII characters other than '/' (and not '.' or "
            f"'..'), got {text[:300]!r}",
            header,
        )
    return text


def parse_priority(value: bytes | None, header: str) -> int:
    if value is None:
        return 0
    try:
        number = int(value)
    except ValueError:
        raise BadRequest(
            f"header {header} must be an integer (lower runs first), got {value[:100]!r}", header
        ) from None
    if not -(2**31) <= number < 2**31:
        raise BadRequest(f"header {header} must be a 32-bit integer, got {number}", header)
    return number


def parse_body(body: bytes) -> tuple[CompletionRequest, bool, int]:
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
    return cast(CompletionRequest, payload), stream, choices


_TRACE_HEADERS = frozenset((b"traceparent", b"tracestate"))


def upstream_headers(
    headers: list[tuple[bytes, bytes]],
    id_header: bytes,
    request_id: str,
    stream: bool,
    trace: list[tuple[bytes, bytes]] = [],  # noqa: B006 (read only)
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop ones, plus the request id and ``trace``: the gateway's
    ``traceparent`` (and the client's ``tracestate``) in place of the client's. A stream is asked for
    unencoded, so that the gateway can append its own final event; other bodies keep the client's
    accept-encoding."""
    out = []
    encoding = b"identity"
    for name, value in headers:
        if name in DROP_REQUEST or name == id_header or name in _TRACE_HEADERS:
            if name == b"accept-encoding" and not stream:
                encoding = value
            continue
        out.append((name, value))
    out.append((b"accept-encoding", encoding))
    out.append((id_header, request_id.encode()))
    out.extend(trace)
    return out
