"""The gateway's own objects (OpenAI error, last chunk of a stream it ends) as the bytes clients get."""

from __future__ import annotations

import json

import msgspec
import pytest

from engine_hooks.events import Command
from engine_hooks.gateway.responses import ErrorBody, OpenAIError, cut_error, error_body, final_chunk


def test_an_error_body_has_the_openai_fields_in_their_order_param_null_when_none():
    assert error_body("no route", "not_found_error", 404) == (
        b'{"error":{"message":"no route","type":"not_found_error","param":null,"code":404}}'
    )
    assert error_body("bad n", "invalid_request_error", 400, "n") == (
        b'{"error":{"message":"bad n","type":"invalid_request_error","param":"n","code":400}}'
    )


def test_a_cut_error_names_the_rule_as_its_code():
    cmd = Command(id="c1", request_id="r1", action="abort", rule="loop", detail="period 3")
    assert cut_error(cmd) == OpenAIError(
        message="the request was cut off by the chunkledger rule 'loop': period 3",
        type="chunkledger_cutoff",
        code="loop",
    )
    assert json.loads(msgspec.json.encode(ErrorBody(cut_error(cmd))))["error"]["code"] == "loop"


def _last(data: bytes) -> dict:
    event, done = data.split(b"\n\n")[:2]
    assert done == b"data: [DONE]" and event.startswith(b"data: ")
    return json.loads(event[6:])


@pytest.mark.parametrize("chat", [True, False])
def test_the_last_chunk_repeats_the_first_events_id_model_created_whatever_their_json(chat):
    first = b'data: {"id":"up-1","model":["odd"],"created":1.5,"choices":[]}\n\n'
    error = OpenAIError(message="m", type="upstream_timeout", code=504)
    end = final_chunk(
        chat=chat,
        choices=2,
        finish_reason="error",
        error=error,
        first_events=first,
        request_id="r",
        model="x",
    )
    chunk = _last(end)
    assert (chunk["id"], chunk["model"], chunk["created"]) == ("up-1", ["odd"], 1.5)
    assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
    assert list(chunk) == ["id", "object", "created", "model", "choices", "error"]
    assert chunk["error"] == {"message": "m", "type": "upstream_timeout", "param": None, "code": 504}
    ends = (
        [{"index": i, "delta": {}, "finish_reason": "error"} for i in range(2)]
        if chat
        else [{"index": i, "text": "", "logprobs": None, "finish_reason": "error"} for i in range(2)]
    )
    assert chunk["choices"] == ends


@pytest.mark.parametrize(
    "first", [None, b"", b"data: [1, 2]\n\n", b"data: {not json\n\n", b": comment\n\n", b'data: {"x":1}\n\n']
)
def test_without_the_fields_in_a_first_json_object_the_last_chunk_has_the_gateways_own(first):
    error = OpenAIError(message="m", type="t", code=502)
    end = final_chunk(
        chat=True,
        choices=1,
        finish_reason="error",
        error=error,
        first_events=first,
        request_id="r9",
        model=None,
    )
    chunk = _last(end)
    assert chunk["id"] == "chatcmpl-r9" and chunk["model"] == "" and isinstance(chunk["created"], int)
