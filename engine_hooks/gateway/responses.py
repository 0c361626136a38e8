"""What the gateway writes itself: OpenAI-style errors, the last chunk of a stream it ends, and the
ASGI messages of a whole response; plus what it reads in the upstream's bytes (finish reasons, choices,
SSE event boundaries).

Everything else the client receives is the upstream's bytes, unchanged.
"""

from __future__ import annotations

import re
import time
from typing import Any

import msgspec

from engine_hooks.events import Command
from engine_hooks.gateway.exchange import Send

_encode = msgspec.json.encode
_decode = msgspec.json.decode
_FINISH_RE = re.compile(rb'"finish_reason"\s*:\s*"([^"\\]{1,64})"')
_CHOICE_RE = re.compile(rb'"choices"\s*:\s*\[\s*\{')
DONE = b"data: [DONE]\n\n"


def error_object(
    message: str, type_: str, code: int | str | None, param: str | None = None
) -> dict[str, Any]:
    return {"message": message, "type": type_, "param": param, "code": code}


def error_body(message: str, type_: str, code: int | str | None, param: str | None = None) -> bytes:
    """``{"error": {...}}`` as the OpenAI API answers errors."""
    return _encode({"error": error_object(message, type_, code, param)})


def cut_error(command: Command) -> dict[str, Any]:
    """The error object of an answer to a cutoff command."""
    detail = f": {command.detail}" if command.detail else ""
    return error_object(
        f"the request was cut off by the chunkledger rule '{command.rule}'{detail}",
        "chunkledger_cutoff",
        command.rule,
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


def first_event_fields(first_events: bytes | None) -> dict[str, Any]:
    """``id``, ``model`` and ``created`` of the first JSON event of a stream, when it has them."""
    if not first_events:
        return {}
    for line in first_events.splitlines():
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload.startswith(b"{"):
                try:
                    obj = _decode(payload)
                except msgspec.DecodeError:
                    return {}
                if isinstance(obj, dict):
                    return {k: obj[k] for k in ("id", "model", "created") if k in obj}
            return {}
    return {}


def final_chunk(
    *,
    chat: bool,
    choices: int,
    finish_reason: str,
    error: dict[str, Any],
    first_events: bytes | None,
    request_id: str,
    model: str | None,
) -> bytes:
    """The last SSE event of a stream the gateway ends: every choice finished, plus an ``error``.

    ``id``, ``model`` and ``created`` repeat the stream's first event so that clients that check them
    accept it; ``[DONE]`` follows, as at the end of any OpenAI stream.
    """
    seen = first_event_fields(first_events)
    if chat:
        choice_list = [{"index": i, "delta": {}, "finish_reason": finish_reason} for i in range(choices)]
        obj = "chat.completion.chunk"
        prefix = "chatcmpl-"
    else:
        choice_list = [
            {"index": i, "text": "", "logprobs": None, "finish_reason": finish_reason} for i in range(choices)
        ]
        obj = "text_completion"
        prefix = "cmpl-"
    chunk = {
        "id": seen.get("id", prefix + request_id),
        "object": obj,
        "created": seen.get("created", int(time.time())),
        "model": seen.get("model", model or ""),
        "choices": choice_list,
        "error": error,
    }
    return b"data: " + _encode(chunk) + b"\n\n" + DONE
