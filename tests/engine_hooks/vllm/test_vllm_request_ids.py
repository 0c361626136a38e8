"""The ledger key of a request served by vLLM's OpenAI server without the gateway: the client's id.

The engine ids are built with vLLM 0.32's own code where it has a function for it (the header/body id:
``BaseServing._base_request_id``; the random suffix: ``InputProcessor.assign_request_id``; the n>1
children: ``ParentRequest.get_child_info``) and with the serving classes' inline f-strings otherwise
(``cmpl-{id}`` + ``-{i}`` per prompt in OpenAIServingCompletion, ``chatcmpl-{id}`` in OpenAIServingChat,
``_{i}`` per conversation in OpenAIServingChatBatch, ``-{random_uuid()}-beam-{i}`` in beam search).
The last test runs the real server with the plugin and reads the events it sent.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import httpx
import msgspec
import pytest
from vllm import SamplingParams
from vllm.entrypoints.serve.engine.serving import BaseServing
from vllm.utils import random_uuid
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.parallel_sampling import ParentRequest

from engine_hooks import events as ev
from engine_hooks.events import Chunk, Finished, Queued, Step, Tokens
from engine_hooks.vllm import scheduler
from engine_hooks.vllm.scheduler import XARGS_KEY, external_request_id
from tests.engine_hooks.vllm.test_vllm_http import server  # noqa: F401 - the fixture: vLLM's OpenAI server with the plugin
from tests.support.fake_ledger import wait_until


def base_id(header: str | None = None, body: str | None = None) -> str:
    """What the serving classes put after ``cmpl-``/``chatcmpl-``: the X-Request-Id header, else the
    body's ``request_id``, else (its default_factory) ``random_uuid()``."""
    raw = SimpleNamespace(headers={} if header is None else {"X-Request-Id": header})
    return str(BaseServing._base_request_id(raw, random_uuid() if body is None else body))


def engine_ids(front_id: str, n: int = 1) -> list[str]:
    """The scheduler's ``request_id`` of each engine request for the front end's ``front_id``: vLLM's
    random suffix added, then fanned out into ``n`` children when n > 1 (as AsyncLLM.add_request)."""
    req = SimpleNamespace(request_id=front_id, external_req_id=None, params=SamplingParams(n=n))
    InputProcessor.assign_request_id(req)
    if n == 1:
        return [req.request_id]
    parent = ParentRequest(req)  # type: ignore[arg-type]
    return [parent.get_child_info(i)[0] for i in range(n)]


def key(request_id: str, extra_args: dict | None = None) -> str:
    req = SimpleNamespace(request_id=request_id, sampling_params=SamplingParams(extra_args=extra_args))
    return external_request_id(req)  # type: ignore[arg-type]


def completion_keys(base: str, prompts: int = 1, n: int = 1) -> list[str]:
    return [key(e) for i in range(prompts) for e in engine_ids(f"cmpl-{base}-{i}", n)]


# -- the rule, on the id shapes of vLLM 0.32 -----------------------------------------------------------


def test_completion_with_an_x_request_id_is_keyed_by_that_id():
    assert completion_keys(base_id(header="abc")) == ["abc"]
    assert completion_keys(base_id(header="abc", body="ignored")) == ["abc"]  # the header wins
    assert completion_keys(base_id(body="body-id-7")) == ["body-id-7"]  # the body's request_id


def test_chat_completion_with_an_x_request_id_is_keyed_by_that_id():
    assert [key(e) for e in engine_ids(f"chatcmpl-{base_id(header='chat-1')}")] == ["chat-1"]
    assert [key(e) for e in engine_ids(f"chatcmpl-{base_id(body='mine')}")] == ["mine"]


def test_request_without_a_client_id_is_keyed_by_the_response_id():
    made = base_id()
    assert re.fullmatch(r"[0-9a-f]{16}", made)  # vLLM's own: random_uuid()
    assert completion_keys(made) == [f"cmpl-{made}"]  # the completion response's "id"
    assert [key(e) for e in engine_ids(f"chatcmpl-{made}")] == [f"chatcmpl-{made}"]
    assert completion_keys(base_id(header="")) == ["cmpl-"]  # an empty X-Request-Id: its response id


def test_each_prompt_of_a_batched_completion_gets_its_own_row_under_the_client_id():
    assert completion_keys("abc", prompts=3) == ["abc", "abc:1", "abc:2"]
    made = base_id()
    assert completion_keys(made, prompts=2) == [f"cmpl-{made}", f"cmpl-{made}:1"]


def test_n_samples_get_their_own_rows_under_the_client_id():
    assert completion_keys("abc", n=3) == ["abc", "abc:0.1", "abc:0.2"]
    assert completion_keys("abc", prompts=2, n=2) == ["abc", "abc:0.1", "abc:1", "abc:1.1"]
    assert [key(e) for e in engine_ids("chatcmpl-chat-1", n=2)] == ["chat-1", "chat-1:0.1"]
    made = base_id()
    assert completion_keys(made, n=2) == [f"cmpl-{made}", f"cmpl-{made}:0.1"]


def test_chat_batch_conversations_are_keyed_by_vllms_sub_ids_under_the_client_id():
    # OpenAIServingChatBatch: f"{request_id}_{i}" for every conversation, the first included.
    assert [key(engine_ids(f"chatcmpl-abc_{i}")[0]) for i in range(2)] == ["abc_0", "abc_1"]
    made = base_id()
    assert key(engine_ids(f"chatcmpl-{made}_1")[0]) == f"chatcmpl-{made}_1"


def test_beam_search_steps_keep_their_beam_tail_under_the_client_id():
    batch = random_uuid()  # beam search's per-step id: f"{request_id}-{random_uuid()}-beam-{i}"
    assert key(engine_ids(f"cmpl-abc-{batch}-beam-1")[0]) == f"abc-{batch}-beam-1"
    assert key(engine_ids(f"chatcmpl-abc-{batch}-beam-0")[0]) == f"abc-{batch}-beam-0"
    made = base_id()
    assert key(engine_ids(f"cmpl-{made}-{batch}-beam-0")[0]) == f"cmpl-{made}-{batch}-beam-0"


def test_client_ids_that_end_like_vllms_additions_are_kept_whole():
    for client in ("job-7", "job_42", "a-deadbeef", "x-1-2", "7_up", "cmpl-nested"):
        assert completion_keys(client) == [client]
        assert [key(e) for e in engine_ids(f"chatcmpl-{client}")] == [client]


def test_a_client_id_of_sixteen_hex_digits_is_keyed_like_vllms_own_by_its_response_id():
    assert completion_keys("0123456789abcdef") == ["cmpl-0123456789abcdef"]
    assert completion_keys("0123456789ABCDEF") == ["0123456789ABCDEF"]  # not random_uuid()'s


def test_distinct_engine_requests_of_one_call_have_distinct_keys():
    keys = completion_keys("abc", prompts=4, n=3)
    assert len(set(keys)) == 12 and keys[0] == "abc"


def test_without_request_id_randomization_no_suffix_is_stripped(monkeypatch):
    monkeypatch.setattr(scheduler, "_RANDOMIZED", False)  # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1
    assert key("chatcmpl-a-deadbeef") == "a-deadbeef"
    assert key("cmpl-abc-1") == "abc:1"


def test_gateway_id_in_extra_args_wins_as_before():
    (engine_id,) = engine_ids("cmpl-abc-2")
    assert key(engine_id, {XARGS_KEY: "gw-1"}) == "gw-1"
    assert key(engine_id, {XARGS_KEY: ""}) == "abc:2"  # not a valid gateway id: the engine's
    assert key(engine_id, {"other": 1}) == "abc:2"


def test_a_client_id_too_long_for_the_contract_is_shortened_to_a_stable_unique_key():
    long_a, long_b = "a" * 300, "a" * 299 + "b"
    (ka,) = [key(e) for e in engine_ids(f"cmpl-{long_a}-0")]
    (kb,) = [key(e) for e in engine_ids(f"cmpl-{long_b}-0")]
    assert len(ka) == len(kb) == 256 and ka != kb
    assert ka.startswith("a" * 239 + "~")
    assert ka == key(engine_ids(f"cmpl-{long_a}-0")[0])  # the same key for every event of the request
    assert (
        msgspec.json.decode(
            msgspec.json.encode({"seq": 1, "ts": 1.0, "request_id": ka, "prompt_tokens": 1}), type=ev.Queued
        ).request_id
        == ka
    )  # the ledger's contract accepts it


def test_ids_from_other_front_ends_only_lose_the_random_suffix_as_before():
    assert [key(e) for e in engine_ids("0")] == ["0"]  # offline LLM: str(next(request_counter))
    assert [key(e) for e in engine_ids("3", n=2)] == ["0_3", "1_3"]
    made = random_uuid()
    assert key(engine_ids(f"resp_{made}_0")[0]) == f"resp_{made}_0"  # the responses API
    assert key(engine_ids(f"embd-{made}")[0]) == f"embd-{made}"


# -- through vLLM's OpenAI server -------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.needs_model  # vLLM's OpenAI server over a real model
def test_openai_server_events_are_keyed_by_the_clients_request_ids(server):  # noqa: F811
    url, ledger, _ = server
    completion = {"model": "tiny", "prompt": "the ledger and the engine", "max_tokens": 3, "ignore_eos": True}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "a chunk budget"}], "max_tokens": 3}
    with httpx.Client(base_url=url, timeout=120) as client:

        def post(path: str, body: dict, request_id: str | None = None) -> dict:
            headers = {} if request_id is None else {"X-Request-Id": request_id}
            response = client.post(path, json=body, headers=headers)
            assert response.status_code == 200, response.text
            return response.json()

        assert post("/v1/completions", completion, "abc")["id"] == "cmpl-abc"
        assert post("/v1/chat/completions", chat, "chat-xyz-1")["id"] == "chatcmpl-chat-xyz-1"
        anonymous = post("/v1/completions", completion)["id"]  # no X-Request-Id: vLLM's own id
        two = post("/v1/completions", {**completion, "prompt": ["one prompt", "another"]}, "multi-1")
        assert len(two["choices"]) == 2
        post("/v1/completions", {**completion, "n": 2}, "n2-1")
    expected = {"abc", "chat-xyz-1", anonymous, "multi-1", "multi-1:1", "n2-1", "n2-1:0.1"}
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", anonymous)

    def of(kind: type) -> list:
        return [e for e in ledger.store.events if isinstance(e, kind)]

    assert wait_until(lambda: {e.request_id for e in of(Finished)} >= expected, 30.0), of(Finished)
    assert sorted(e.request_id for e in of(Queued)) == sorted(expected)
    assert sorted(e.request_id for e in of(Finished)) == sorted(expected)
    assert {e.request_id for e in of(Chunk)} == expected
    assert {e.request_id for e in of(Tokens)} == expected
    assert {r for s in of(Step) for r in s.request_ids} == expected
