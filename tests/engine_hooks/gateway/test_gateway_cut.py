"""Stream cut: cutoff commands from the (fake) ledger end the request the gateway is relaying."""

from __future__ import annotations

import json
import threading
import time

import httpx

from engine_hooks.events import Command, Completed, CutoffApplied, StreamCut
from tests.engine_hooks.gateway.gateway_helpers import events_of, hold_slot, kinds_of
from tests.support.fake_ledger import wait_until


def send_command(gateway_url: str, ledger, command: Command) -> None:
    """Have the fake ledger hand ``command`` to the gateway.

    The fake ledger answers commands only in ingest responses (it has no long-poll), and a gateway that
    is only streaming emits nothing, so a bad request (events, no upstream call, no admission) makes
    it post. The real ledger's long-poll path is tested in test_gateway_real_ledger.py.
    """
    ledger.commands = [command]
    nudge = httpx.post(gateway_url + "/v1/completions", content=b"[]", headers={"x-request-id": "nudge"})
    assert nudge.status_code == 400


def sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def test_cut_stream_ends_with_a_final_chunk_naming_the_rule_then_done(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    body = b""
    with (
        httpx.Client(timeout=10) as client,
        client.stream(
            "POST",
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 1000},
            headers={"x-fake-delay-ms": "20", "x-request-id": "runaway-1"},
        ) as response,
    ):
        for chunk in response.iter_raw():
            if not body:
                command = Command(
                    id="cmd-1", request_id="runaway-1", action="abort", rule="loop", detail="period 3 x40"
                )
                send_command(gw.url, fake_ledger, command)
            body += chunk
    events = sse_events(body)
    assert events[-1] == b"data: [DONE]"
    assert 2 <= len(events) < 900
    for event in events[:-2]:  # what the upstream sent, whole events only
        assert json.loads(event[6:])["choices"][0]["finish_reason"] is None
    final = json.loads(events[-2][6:])
    assert final["error"]["code"] == "loop"
    assert final["error"]["type"] == "chunkledger_cutoff"
    assert "rule 'loop'" in final["error"]["message"] and "period 3 x40" in final["error"]["message"]
    assert final["choices"] == [{"index": 0, "delta": {}, "finish_reason": "cutoff"}]
    assert final["id"] == "chatcmpl-runaway-1" and final["object"] == "chat.completion.chunk"
    assert wait_until(lambda: "runaway-1" in upstream.app.disconnected)  # upstream aborted
    gw.flush()
    assert wait_until(lambda: "cutoff_applied" in kinds_of(fake_ledger, "runaway-1"))
    mine = events_of(fake_ledger, "runaway-1")
    cut = next(e for e in mine if isinstance(e, StreamCut))
    assert (cut.rule, cut.command_id) == ("loop", "cmd-1")
    applied = next(e for e in mine if isinstance(e, CutoffApplied))
    assert (applied.command_id, applied.action, applied.rule) == ("cmd-1", "abort", "loop")
    completed = next(e for e in mine if isinstance(e, Completed))
    assert (completed.status_code, completed.finish_reason) == (200, "cutoff")
    assert wait_until(lambda: gw.gateway.queue.in_flight == 0)


def test_cut_completions_stream_uses_the_completions_chunk_shape(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    fake_ledger.commands = [Command(id="cmd-2", request_id="runaway-2", action="abort", rule="token_cap")]
    with httpx.Client(timeout=10) as client:
        r = client.post(
            gw.url + "/v1/completions",
            json={"model": "m", "stream": True, "max_tokens": 1000, "n": 2},
            headers={"x-fake-delay-ms": "20", "x-request-id": "runaway-2"},
        )
    final = json.loads(sse_events(r.content)[-2][6:])
    assert final["object"] == "text_completion"
    assert [c["finish_reason"] for c in final["choices"]] == ["cutoff", "cutoff"]
    assert final["error"]["code"] == "token_cap"


def test_cut_non_streaming_request_gets_an_error_naming_the_rule(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)

    def cut_once_upstream_has_it() -> None:
        wait_until(lambda: any(r.request_id == "slow-json" for r in upstream.app.requests))
        send_command(
            gw.url,
            fake_ledger,
            Command(id="cmd-3", request_id="slow-json", action="abort", rule="wall_clock"),
        )

    threading.Thread(target=cut_once_upstream_has_it, daemon=True).start()
    with httpx.Client(timeout=10) as client:
        r = client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "max_tokens": 100},  # the fake answers after 100 x 50 ms
            headers={"x-fake-delay-ms": "50", "x-request-id": "slow-json"},
        )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "wall_clock" and error["type"] == "chunkledger_cutoff"
    assert r.headers["x-request-id"] == "slow-json"
    assert wait_until(lambda: "slow-json" in upstream.app.disconnected)  # upstream aborted
    gw.flush()
    assert wait_until(lambda: "stream_cut" in kinds_of(fake_ledger, "slow-json"))


def test_cut_while_waiting_for_admission_answers_without_forwarding(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url, max_in_flight=1)
    results: dict[str, httpx.Response] = {}

    def call(rid: str, delay: str) -> None:
        with httpx.Client(timeout=10) as client:
            results[rid] = client.post(
                gw.url + "/v1/chat/completions",
                json={"model": "m", "stream": True, "max_tokens": 20},
                headers={"x-fake-delay-ms": delay, "x-request-id": rid},
            )

    with hold_slot(gw.url):
        waiter = threading.Thread(target=call, args=("queued", "0"))
        waiter.start()
        assert wait_until(lambda: gw.gateway.queue.depth == 1)
        send_command(
            gw.url, fake_ledger, Command(id="cmd-4", request_id="queued", action="abort", rule="loop")
        )
        waiter.join(10)
        assert gw.gateway.queue.in_flight == 1  # the holder was not disturbed
    events = sse_events(results["queued"].content)
    assert len(events) == 2 and events[-1] == b"data: [DONE]"
    assert json.loads(events[0][6:])["error"]["code"] == "loop"
    assert [r.request_id for r in upstream.app.requests] == ["holder"]


def test_commands_for_other_requests_or_engine_actions_leave_the_stream_alone(
    upstream, make_gateway, fake_ledger
):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url)
    fake_ledger.commands = [
        Command(id="c-a", request_id="someone-else", action="abort", rule="loop"),
        Command(id="c-b", request_id="keep-me", action="slow_pool", rule="preemptions"),
    ]
    with httpx.Client(timeout=10) as client:
        r = client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 15},
            headers={"x-fake-delay-ms": "20", "x-request-id": "keep-me"},
        )
    events = sse_events(r.content)
    assert len(events) == 16 and b'"error"' not in r.content
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
    gw.flush()
    assert "stream_cut" not in kinds_of(fake_ledger, "keep-me")
    assert gw.gateway.registry.get_sample_value("chunkledger_gateway_commands_total") == 2


def test_the_gateway_exporter_does_not_poll_for_commands_beside_the_gateways_own_poll(
    upstream, make_gateway, fake_ledger
):
    make_gateway(upstream.url, fake_ledger.url, poll_commands=False)
    time.sleep(1.5)
    assert fake_ledger.polls == []  # with its own poller off, nothing polls: not the exporter either
