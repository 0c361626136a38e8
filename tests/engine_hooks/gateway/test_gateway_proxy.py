"""The proxy: pass-through, request ids, errors and faults of the upstream (fake upstream, fake ledger)."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import pytest

from bench.toolkit import free_port
from engine_hooks.events import ClientDisconnected, Completed
from engine_hooks.gateway.config import GatewayConfig, GatewayConfigError
from engine_hooks.gateway.responses import last_finish_reason
from tests.engine_hooks.gateway.gateway_helpers import kinds_of
from tests.support.fake_ledger import wait_until
from tests.support.fake_upstream import split_writes


def sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def data_of(event: bytes) -> dict:
    assert event.startswith(b"data: "), event
    return json.loads(event[6:])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_passes_through_byte_for_byte(upstream, make_gateway, path):
    gw = make_gateway(upstream.url)
    body = {"model": "m", "stream": True}
    with httpx.Client() as client:
        via = client.post(gw.url + path, json=body, headers={"x-fake": "split", "x-request-id": "rid-split"})
        direct = client.post(
            upstream.url + path, json=body, headers={"x-fake": "split", "x-request-id": "rid-split"}
        )
    assert via.status_code == direct.status_code == 200
    assert (
        via.content
        == direct.content
        == b"".join(split_writes(path.endswith("chat/completions"), "rid-split"))
    )
    assert via.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert via.headers["x-upstream"] == "fake"
    assert via.headers["x-request-id"] == "rid-split"


def test_stream_chunks_reach_the_client_as_they_arrive(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    arrivals = []
    with (
        httpx.Client() as client,
        client.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 4},
            headers={"x-fake-delay-ms": "150"},
        ) as response,
    ):
        for _chunk in response.iter_raw():
            arrivals.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert len(arrivals) >= 4
    assert sum(1 for g in gaps if g > 0.1) >= 3, gaps  # not buffered until the end


def test_non_streaming_status_headers_and_body_pass_through(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        via = client.post(
            gw.url + "/v1/completions", json={"model": "m", "max_tokens": 3}, headers={"x-request-id": "same"}
        )
        direct = client.post(
            upstream.url + "/v1/completions",
            json={"model": "m", "max_tokens": 3},
            headers={"x-request-id": "same"},
        )
    assert via.status_code == 200
    assert via.content == direct.content
    assert via.headers["content-length"] == str(len(direct.content))
    assert via.headers["x-upstream"] == "fake"


def test_request_id_from_the_client_goes_upstream_in_header_and_vllm_xargs(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        r = client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "max_tokens": 1, "vllm_xargs": {"session_id": "s1"}, "extra": [1, 2.5, None]},
            headers={"X-Request-Id": "client-chosen-1", "Authorization": "Bearer upstream-key"},
        )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "client-chosen-1"
    seen = upstream.app.requests[-1]
    assert seen.headers["x-request-id"] == "client-chosen-1"
    assert seen.headers["authorization"] == "Bearer upstream-key"  # vLLM's --api-key checks it
    assert seen.body["vllm_xargs"] == {"session_id": "s1", "chunkledger_request_id": "client-chosen-1"}
    assert seen.body["extra"] == [1, 2.5, None]
    assert seen.body["model"] == "m"


def test_request_id_is_assigned_when_the_client_sends_none(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        ids = {
            client.post(gw.url + "/v1/completions", json={"model": "m"}).headers["x-request-id"]
            for _ in range(3)
        }
    assert len(ids) == 3
    sent = [
        (r.headers["x-request-id"], r.body["vllm_xargs"]["chunkledger_request_id"])
        for r in upstream.app.requests
    ]
    assert all(h == x for h, x in sent)
    assert {h for h, _ in sent} == ids


@pytest.mark.parametrize(
    ("body", "headers", "needle"),
    [
        (b"{not json", {}, "not valid JSON"),
        (b"[1, 2]", {}, "must be a JSON object"),
        (b'{"stream": "yes"}', {}, "stream must be a boolean"),
        (b'{"n": 0}', {}, "n must be an integer"),
        (b'{"vllm_xargs": [1]}', {}, "vllm_xargs must be an object"),
        (b"{}", {"x-priority": "high"}, "x-priority must be an integer"),
        (b"{}", {"x-request-id": "has space"}, "x-request-id must be 1-256 visible ASCII"),
        # the ledger reads an id back as one path segment: '/' and dot segments could not be read
        (b"{}", {"x-request-id": "a/b"}, "other than '/'"),
        (b"{}", {"x-request-id": ".."}, "other than '/'"),
        (b"{}", {"x-request-id": "."}, "other than '/'"),
    ],
)
def test_bad_request_is_400_naming_the_reason_and_is_not_forwarded(
    upstream, make_gateway, body, headers, needle
):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        r = client.post(
            gw.url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json", **headers},
        )
    assert r.status_code == 400
    error = r.json()["error"]
    assert needle in error["message"]
    assert error["type"] == "invalid_request_error"
    assert upstream.app.requests == []


def test_upstream_500_passes_through(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    with httpx.Client() as client:
        r = client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True},
            headers={"x-fake": "status-500", "x-request-id": "r500"},
        )
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "upstream exploded"
    gw.flush()
    completed = [e for e in fake_ledger.store.events if isinstance(e, Completed) and e.request_id == "r500"]
    assert [e.status_code for e in completed] == [500]


def test_upstream_unreachable_is_502_with_an_openai_error(make_gateway):
    port = free_port()  # nothing listens there
    gw = make_gateway(f"http://127.0.0.1:{port}", connect_timeout_s=1.0)
    with httpx.Client() as client:
        r = client.post(gw.url + "/v1/chat/completions", json={"model": "m", "stream": True})
    assert r.status_code == 502
    error = r.json()["error"]
    assert error["type"] == "upstream_unreachable"
    assert "cannot connect to the upstream" in error["message"]
    assert r.headers["x-request-id"]


def test_upstream_hang_mid_stream_ends_with_an_error_chunk_after_the_read_timeout(upstream, make_gateway):
    gw = make_gateway(upstream.url, read_timeout_s=0.5)
    started = time.monotonic()
    with httpx.Client(timeout=10) as client:
        r = client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 10},
            headers={"x-fake": "hang-after-2", "x-request-id": "hang"},
        )
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 8  # the read timeout, plus slack for a loaded machine
    events = sse_events(r.content)
    assert events[-1] == b"data: [DONE]"
    assert [data_of(e)["choices"][0]["delta"]["content"] for e in events[:2]] == ["tok0 ", "tok1 "]
    final = data_of(events[-2])
    assert final["error"]["type"] == "upstream_timeout"
    assert final["choices"][0]["finish_reason"] == "error"
    assert final["id"] == "chatcmpl-hang"
    assert final["model"] == "fake-model"
    assert wait_until(lambda: "hang" in upstream.app.disconnected)  # the hung request was closed


def test_upstream_dropping_the_connection_mid_stream_ends_with_an_error_chunk(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client(timeout=10) as client:
        r = client.post(
            gw.url + "/v1/completions",
            json={"model": "m", "stream": True, "max_tokens": 10},
            headers={"x-fake": "close-after-3"},
        )
    events = sse_events(r.content)
    assert len(events) == 5 and events[-1] == b"data: [DONE]"
    final = data_of(events[-2])
    assert final["error"]["type"] == "upstream_error"
    assert final["object"] == "text_completion"
    assert final["choices"][0]["finish_reason"] == "error"


def test_slow_upstream_within_the_read_timeout_is_relayed(upstream, make_gateway):
    gw = make_gateway(upstream.url, read_timeout_s=2.0)
    with httpx.Client(timeout=10) as client:
        r = client.post(
            gw.url + "/v1/completions",
            json={"model": "m", "stream": True, "max_tokens": 2},
            headers={"x-fake": "slow-headers-0.6", "x-fake-delay-ms": "300"},
        )
    assert r.status_code == 200
    assert sse_events(r.content)[-1] == b"data: [DONE]"


def test_upstream_silent_before_headers_is_504(upstream, make_gateway):
    gw = make_gateway(upstream.url, read_timeout_s=0.3)
    with httpx.Client(timeout=10) as client:
        r = client.post(gw.url + "/v1/completions", json={"model": "m"}, headers={"x-fake": "slow-headers-2"})
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "upstream_timeout"


def test_client_disconnect_aborts_the_upstream_request(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    with (
        httpx.Client(timeout=10) as client,
        client.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 1000},
            headers={"x-fake-delay-ms": "20", "x-request-id": "leaver"},
        ) as response,
    ):
        first = next(response.iter_raw())
        assert first.startswith(b"data: ")
    # leaving the block closes the connection mid-stream
    assert wait_until(lambda: "leaver" in upstream.app.disconnected, timeout=5)
    assert "leaver" not in upstream.app.completed
    gw.flush()
    assert wait_until(lambda: "client_disconnected" in kinds_of(fake_ledger, "leaver"))
    assert "completed" not in kinds_of(fake_ledger, "leaver")
    event = next(e for e in fake_ledger.store.events if isinstance(e, ClientDisconnected))
    assert event.since_arrived_s is not None and event.since_arrived_s > 0
    assert wait_until(lambda: gw.gateway.queue.in_flight == 0)


def test_a_second_request_with_an_id_in_flight_is_refused_with_409_and_sends_no_event(
    upstream, make_gateway, fake_ledger
):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    with (
        httpx.Client(timeout=10) as client,
        client.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 5},
            headers={"x-fake-delay-ms": "50", "x-request-id": "twice"},
        ) as first,
    ):
        second = client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "max_tokens": 2},
            headers={"x-request-id": "twice"},
        )
        assert second.status_code == 409
        assert "x-request-id" in second.json()["error"]["message"]
        assert second.json()["error"]["param"] == "x-request-id"
        first.read()
    assert first.status_code == 200
    gw.flush()
    assert wait_until(lambda: "completed" in kinds_of(fake_ledger, "twice"))
    assert kinds_of(fake_ledger, "twice").count("arrived") == 1  # one request's events in its row
    assert [r.headers.get("x-request-id") for r in upstream.app.requests] == ["twice"]  # not forwarded
    # once the first is done, the id may be used again
    with httpx.Client(timeout=10) as client:
        again = client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "max_tokens": 2},
            headers={"x-request-id": "twice"},
        )
    assert again.status_code == 200


def test_models_passes_through_without_admission(upstream, make_gateway):
    gw = make_gateway(upstream.url, max_in_flight=1)
    with httpx.Client() as client:
        r = client.get(gw.url + "/v1/models")
    assert r.status_code == 200
    assert r.json()["data"][0]["id"] == "fake-model"
    assert upstream.app.requests[-1].path == "/v1/models"


def test_unknown_route_is_404_and_wrong_method_405(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        assert client.get(gw.url + "/v1/embeddings").status_code == 404
        r = client.get(gw.url + "/v1/chat/completions")
    assert r.status_code == 405
    assert "takes POST" in r.json()["error"]["message"]


def test_gateway_events_carry_monotonic_durations(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    with httpx.Client() as client:
        client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 3},
            headers={"x-request-id": "timed", "x-priority": "-2"},
        )
    gw.flush()
    assert kinds_of(fake_ledger, "timed") == [
        "arrived",
        "admission_enqueued",
        "admitted",
        "first_byte",
        "first_token_out",
        "completed",
    ]
    arrived, enqueued, admitted, first_byte, first_out, completed = [
        e for e in fake_ledger.store.events if getattr(e, "request_id", None) == "timed"
    ]
    assert arrived.endpoint == "/v1/chat/completions" and arrived.stream and arrived.priority == -2
    assert 0 <= enqueued.entry_s < 0.5
    assert admitted.wait_s == 0.0 and admitted.in_flight == 1
    assert 0 < first_byte.since_arrived_s <= first_out.since_arrived_s
    assert first_out.since_arrived_s <= completed.last_token_out_s <= completed.since_arrived_s
    assert completed.status_code == 200 and completed.finish_reason == "length"
    assert arrived.ts <= enqueued.ts <= admitted.ts <= first_byte.ts <= first_out.ts <= completed.ts


def test_config_errors_name_the_setting():
    with pytest.raises(GatewayConfigError, match="max_in_flight"):
        GatewayConfig.create(upstream="http://x", max_in_flight=0)
    with pytest.raises(GatewayConfigError, match="upstream must start with http"):
        GatewayConfig.create(upstream="localhost:8000")
    with pytest.raises(GatewayConfigError, match="unknown gateway setting"):
        GatewayConfig.create(upstream="http://x", max_inflight=3)


def test_upstream_cookies_reach_the_client_and_are_not_replayed_to_the_upstream(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as first, httpx.Client() as second:
        r = first.post(gw.url + "/v1/completions", json={"model": "m", "max_tokens": 1})
        assert r.headers["set-cookie"] == "fake-session=1; Path=/"
        second.post(gw.url + "/v1/completions", json={"model": "m", "max_tokens": 1})
    assert "cookie" not in upstream.app.requests[-1].headers  # the gateway keeps no cookie jar


def test_query_string_goes_upstream(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        assert client.post(gw.url + "/v1/completions?api-version=2", json={"model": "m"}).status_code == 200
    assert upstream.app.requests[-1].query == "api-version=2"


def test_a_pooled_connection_the_upstream_closed_is_not_reused(make_gateway):
    from engine_hooks.gateway.server import ServerThread
    from tests.support.fake_upstream import FakeUpstream

    quick = ServerThread(FakeUpstream(), timeout_keep_alive=0.2).start()  # closes idle connections fast
    try:
        gw = make_gateway(quick.url)
        with httpx.Client() as client:
            for _ in range(3):
                r = client.post(
                    gw.url + "/v1/completions", json={"model": "m", "stream": True, "max_tokens": 2}
                )
                assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
                time.sleep(0.5)  # the upstream has closed the pooled connection by now
    finally:
        quick.stop()


def test_sequential_requests_reuse_one_upstream_connection(upstream, make_gateway):
    gw = make_gateway(upstream.url)
    with httpx.Client() as client:
        for stream in (True, False, True):
            body = {"model": "m", "stream": stream, "max_tokens": 3}
            assert client.post(gw.url + "/v1/completions", json=body).status_code == 200
    assert len({seen.client for seen in upstream.app.requests}) == 1  # one keep-alive connection upstream


@pytest.mark.parametrize(
    ("piece", "reason"),
    [
        (b'data: {"choices":[{"finish_reason":null}]}\n\n' * 3, None),
        (
            b'data: {"choices":[{"finish_reason":null}]}\n\ndata: {"choices":[{"finish_reason":"stop"}]}\n\n',
            "stop",
        ),
        (b'{"choices":[{"finish_reason" : "length"},{"finish_reason":null}]}', "length"),
        (b'{"choices":[{"finish_reason":"stop"},{"finish_reason": "length"}]}', "length"),
        (b"data: [DONE]\n\n", None),
    ],
)
def test_last_finish_reason_is_the_last_non_null_one(piece, reason):
    assert last_finish_reason(piece) == reason


def test_a_stream_is_complete_at_done_even_if_the_upstream_ends_its_body_later(
    upstream, make_gateway, fake_ledger
):
    """The client has everything once [DONE] is relayed: the response ends there (no wait for the
    upstream's end of body), and a client that closes right after it is no disconnect."""
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    with httpx.Client(timeout=10) as client:
        t = time.monotonic()
        r = client.post(
            gw.url + "/v1/completions",
            json={"model": "m", "stream": True, "max_tokens": 3},
            headers={"x-fake": "linger-after-done-0.8", "x-request-id": "done-then-gone"},
        )
        took = time.monotonic() - t
    assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
    assert took < 0.6  # the upstream lingers 0.8 s after [DONE]
    gw.flush()
    assert wait_until(lambda: "completed" in kinds_of(fake_ledger, "done-then-gone"))
    assert "client_disconnected" not in kinds_of(fake_ledger, "done-then-gone")
    done = next(
        e for e in fake_ledger.store.events if isinstance(e, Completed) and e.request_id == "done-then-gone"
    )
    assert done.status_code == 200 and done.finish_reason == "length"
    # the upstream's body is still read to its end (within 1 s), so its connection is not aborted
    assert wait_until(lambda: "done-then-gone" in upstream.app.completed, timeout=5)
    assert "done-then-gone" not in upstream.app.disconnected


@pytest.mark.parametrize("stream", [True, False])
def test_first_and_last_token_out_are_when_content_reached_the_client(
    upstream, make_gateway, fake_ledger, stream
):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    rid = f"out-{stream}"
    with httpx.Client(timeout=10) as client:
        t = time.monotonic()
        r = client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": stream, "max_tokens": 6},
            headers={"x-fake-delay-ms": "50", "x-request-id": rid},
        )
        took = time.monotonic() - t
    assert r.status_code == 200
    gw.flush()
    assert wait_until(lambda: "completed" in kinds_of(fake_ledger, rid))
    mine = [e for e in fake_ledger.store.events if getattr(e, "request_id", None) == rid]
    first = next(e for e in mine if type(e).__struct_config__.tag == "first_token_out")
    done = next(e for e in mine if isinstance(e, Completed))
    if stream:  # chunk i is due i x 50 ms after the first: first out early, last out ~250 ms later
        assert first.since_arrived_s < 0.2
        assert 0.2 < done.last_token_out_s - first.since_arrived_s < took
    else:  # a whole body: every token reaches the client with it
        assert first.since_arrived_s > 0.25
        assert first.since_arrived_s <= done.last_token_out_s <= done.since_arrived_s


@pytest.mark.parametrize(
    ("piece", "token"),
    [
        (b'data: {"choices":[{"index":0,"text":"","finish_reason":null}]}\n\n', True),  # empty text counts
        (b'data: {"choices": [ {"index":0,"delta":{"role":"assistant"}}]}\n\n', True),
        (b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n', False),  # the usage summary
        (b"data: [DONE]\n\n", False),
        (b": ping\n\n", False),
    ],
)
def test_a_piece_carries_a_token_when_it_has_a_choice(piece, token):
    from engine_hooks.gateway.responses import has_choice

    assert has_choice(piece) is token


class _Recorder:
    """What ``_OutTimes`` reports to: the first-token events and histogram observations."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, float]] = []
        self.observed: list[float] = []
        self.metrics = type("M", (), {"first_token": type("H", (), {"observe": self.observed.append})()})()

    def e_first_token_out(self, ts: float, rid: str, since: float) -> None:
        self.events.append((ts, rid, since))


def test_token_out_times_are_read_before_the_write_and_count_only_writes_that_returned():
    from engine_hooks.gateway.app import _OutTimes

    rec = _Recorder()
    t0 = time.monotonic()
    out = _OutTimes(rec, "r", t0)  # type: ignore[arg-type]
    out.writing(b": ping\n\n")  # no choice: not a token
    out.written()
    assert out.first is None and not rec.events
    wall = time.time()
    out.writing(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
    before, before_wall = time.monotonic(), time.time()
    time.sleep(0.05)  # a slow write: the client cannot have read it before it began
    out.written()
    assert out.first is not None and out.first <= before
    ((ts, rid, since),) = rec.events
    assert wall <= ts <= before_wall  # the event's wall clock is the write's start too
    assert (rid, since) == ("r", out.first - t0) and rec.observed == [out.first - t0]
    first = out.first
    out.writing(b'data: {"choices":[{"index":0,"text":"b"}]}\n\n')  # this write raises: not counted
    assert out.last == first
    out.writing(b'data: {"choices":[{"index":0,"text":"c"}]}\n\n')
    out.written()
    assert out.first == first and out.last is not None and out.last > first
    assert len(rec.events) == 1  # one first token
