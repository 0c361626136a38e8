"""What the gateway writes itself: OpenAI-style errors, the last chunk of a stream it ends, and the
ASGI messages of a whole response; plus what it reads in the upstream's bytes (finish reasons, choices,
SSE event boundaries).

Everything else the client receives is the upstream's bytes, unchanged.
"""

from __future__ import annotations

import re
import time

import msgspec

from engine_hooks.events import Command
from engine_hooks.gateway.exchange import Send

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_FINISH_RE = re.compile(rb'"finish_reason"\s*:\s*"([^"\\]{1,64})"')
_CHOICE_RE = re.compile(rb'"choices"\s*:\s*\[\s*\{')
DONE = b"data: [DONE]\n\n"


class OpenAIError(msgspec.Struct, kw_only=True, frozen=True):
    """The error object of the OpenAI API: the ``error`` of an error response's body, and of the last
    event of a stream the gateway ends. Encoded in this field order."""

    message: str
    type: str  # e.g. "invalid_request_error", "upstream_timeout", "chunkledger_cutoff"
    param: str | None = None  # the request field or header at fault
    code: int | str | None  # the HTTP status, or the rule of a cutoff


class ErrorBody(msgspec.Struct, frozen=True):
    """``{"error": {...}}``: the body of the gateway's error responses."""

    error: OpenAIError


def error_body(message: str, type_: str, code: int | str | None, param: str | None = None) -> bytes:
    """``{"error": {...}}`` as the OpenAI API answers errors."""
    return _encode(ErrorBody(OpenAIError(message=message, type=type_, param=param, code=code)))


def cut_error(command: Command) -> OpenAIError:
    """The error object of an answer to a cutoff command."""
    detail = f": {command.detail}" if command.detail else ""
    return OpenAIError(
        message=f"the request was cut off by the chunkledger rule '{command.rule}'{detail}",
        type="chunkledger_cutoff",
        code=command.rule,
    )


async def send_all(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """A whole response: its head and its body, in two ASGI messages."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    request_id: str | None = None,
    id_header: bytes = b"x-request-id",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """A whole JSON response, with the request id in ``id_header`` when there is one."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if request_id is not None:
        headers.append((id_header, request_id.encode()))
    if extra:
        headers.extend(extra)
    await send_all(send, status, headers, body)


def last_finish_reason(data: bytes) -> str | None:
    """The last non-null ``finish_reason`` in a piece of response body (a regex: no JSON parse).

    Most stream pieces carry only ``"finish_reason":null`` (compact JSON, as vLLM writes it): two
    counts answer those without the regex."""
    if data.count(b'"finish_reason"') == data.count(b'"finish_reason":null'):
        return None
    found = None
    for match in _FINISH_RE.finditer(data):
        found = match.group(1)
    return found.decode("utf-8", "replace") if found is not None else None


def has_choice(data: bytes) -> bool:
    """Whether a piece of response body holds an event with a choice: a generated token as clients
    time it (vLLM's benchmark client and OpenAI's SDK take every such chunk as a token, empty text
    included; a usage summary has ``"choices":[]``)."""
    return _CHOICE_RE.search(data) is not None


def ends_stream(data: bytes) -> bool:
    """Whether a piece of an SSE stream ends with ``data: [DONE]``: the stream is complete for the
    client, whatever the upstream's connection does next."""
    return data.endswith(DONE) or data.rstrip().endswith(b"data: [DONE]")


def event_boundary(data: bytes) -> int:
    """Length of the prefix of ``data`` made of complete SSE events (each ends with a blank line)."""
    if data.endswith(b"\n\n"):
        return len(data)
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


class StreamHead(msgspec.Struct, frozen=True):
    """``id``, ``model`` and ``created`` of a stream's first JSON event as the upstream wrote them (any
    JSON value, repeated as is), each ``UNSET`` when the event lacks it."""

    id: object = msgspec.UNSET
    model: object = msgspec.UNSET
    created: object = msgspec.UNSET


_NO_HEAD = StreamHead()
_decode_head = msgspec.json.Decoder(StreamHead).decode


def first_event_fields(first_events: bytes | None) -> StreamHead:
    """``id``, ``model`` and ``created`` of the first JSON event of a stream, when it has them."""
    if not first_events:
        return _NO_HEAD
    for line in first_events.splitlines():
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload.startswith(b"{"):
                try:
                    return _decode_head(payload)
                except msgspec.DecodeError:  # not JSON, or not an object
                    return _NO_HEAD
            return _NO_HEAD
    return _NO_HEAD


class _NoDelta(msgspec.Struct, frozen=True):
    """The empty ``delta`` of a chat choice's last chunk: ``{}``."""


class ChatChoiceEnd(msgspec.Struct, frozen=True):
    """A choice's last chunk in a chat completion stream."""

    index: int
    delta: _NoDelta
    finish_reason: str


class TextChoiceEnd(msgspec.Struct, frozen=True):
    """A choice's last chunk in a completion stream."""

    index: int
    text: str
    logprobs: None
    finish_reason: str


class FinalChunk(msgspec.Struct, frozen=True):
    """The last event of a stream the gateway ends: a chunk as the upstream's, with an ``error``."""

    id: object  # as the stream's first event had them (:class:`StreamHead`), else the gateway's own
    object_: str = msgspec.field(name="object")  # "chat.completion.chunk" or "text_completion"
    created: object
    model: object
    choices: list[ChatChoiceEnd] | list[TextChoiceEnd]
    error: OpenAIError


_NO_DELTA = _NoDelta()


def final_chunk(
    *,
    chat: bool,
    choices: int,
    finish_reason: str,
    error: OpenAIError,
    first_events: bytes | None,
    request_id: str,
    model: str | None,
) -> bytes:
    """The last SSE event of a stream the gateway ends: every choice finished, plus an ``error``.

    ``id``, ``model`` and ``created`` repeat the stream's first event so that clients that check them
    accept it; ``[DONE]`` follows, as at the end of any OpenAI stream.
    """
    seen = first_event_fields(first_events)
    choice_list: list[ChatChoiceEnd] | list[TextChoiceEnd]
    if chat:
        choice_list = [ChatChoiceEnd(i, _NO_DELTA, finish_reason) for i in range(choices)]
        obj = "chat.completion.chunk"
        prefix = "chatcmpl-"
    else:
        choice_list = [TextChoiceEnd(i, "", None, finish_reason) for i in range(choices)]
        obj = "text_completion"
        prefix = "cmpl-"
    chunk = FinalChunk(
        id=prefix + request_id if seen.id is msgspec.UNSET else seen.id,
        object_=obj,
        created=int(time.time()) if seen.created is msgspec.UNSET else seen.created,
        model=(model or "") if seen.model is msgspec.UNSET else seen.model,
        choices=choice_list,
        error=error,
    )
    return b"data: " + _encode(chunk) + b"\n\n" + DONE
