"""Admission queue: the concurrency bound, order, refusals, and what the gateway exports about it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from engine_hooks.events import AdmissionEnqueued, Admitted, Completed
from engine_hooks.gateway.admission import AdmissionQueue, QueueFull, QueueTimeout
from tests.engine_hooks.gateway.gateway_helpers import hold_slot, kinds_of
from tests.support.fake_ledger import wait_until


def run(coro):
    return asyncio.run(coro)


def test_at_most_max_in_flight_hold_a_slot_and_waiters_go_in_fifo_order():
    async def main():
        q = AdmissionQueue(max_in_flight=2, max_queue=10, max_wait_s=5)
        order = []
        assert await q.acquire() == 0.0
        assert await q.acquire() == 0.0

        async def wait(name):
            await q.acquire()
            order.append(name)

        tasks = [asyncio.ensure_future(wait(n)) for n in "abc"]
        await asyncio.sleep(0.01)
        assert (q.in_flight, q.depth, order) == (2, 3, [])
        for _ in range(3):
            q.release()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "c"]
        assert (q.in_flight, q.depth) == (2, 0)

    run(main())


def test_lower_priority_value_is_admitted_first_fifo_within_a_priority():
    async def main():
        q = AdmissionQueue(max_in_flight=1, max_queue=10, max_wait_s=5)
        await q.acquire()
        order = []

        async def wait(name, priority):
            await q.acquire(priority)
            order.append(name)
            q.release()

        tasks = [
            asyncio.ensure_future(wait(n, p))
            for n, p in [("low1", 5), ("high1", -1), ("low2", 5), ("high2", -1)]
        ]
        await asyncio.sleep(0.01)
        q.release()
        await asyncio.gather(*tasks)
        assert order == ["high1", "high2", "low1", "low2"]
        assert q.in_flight == 0

    run(main())


def test_a_full_queue_refuses_at_once_and_a_long_wait_times_out():
    async def main():
        q = AdmissionQueue(max_in_flight=1, max_queue=1, max_wait_s=0.05, retry_after_s=2)
        await q.acquire()
        waiting = asyncio.ensure_future(q.acquire())
        await asyncio.sleep(0)
        with pytest.raises(QueueFull) as full:
            await q.acquire()
        assert full.value.status == 429 and full.value.retry_after_s == 2
        with pytest.raises(QueueTimeout) as late:
            await waiting
        assert late.value.status == 503 and "0.05" in str(late.value)
        assert (q.in_flight, q.depth) == (1, 0)
        q.release()
        assert q.in_flight == 0

    run(main())


def test_a_cancelled_waiter_leaves_the_queue_and_never_leaks_a_slot():
    async def main():
        q = AdmissionQueue(max_in_flight=1, max_queue=10, max_wait_s=5)
        await q.acquire()
        gone = asyncio.ensure_future(q.acquire())
        stays = asyncio.ensure_future(q.acquire())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert q.depth == 1
        q.release()  # skips the cancelled waiter
        await stays
        assert q.in_flight == 1
        # a waiter cancelled in the same loop turn as it was handed a slot gives the slot back
        late = asyncio.ensure_future(q.acquire())
        await asyncio.sleep(0)
        q.release()
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late
        assert (q.in_flight, q.depth) == (0, 0)

    run(main())


def _post(url: str, rid: str, results: dict, **headers: str) -> None:
    with httpx.Client(timeout=20) as client:
        results[rid] = client.post(
            url + "/v1/chat/completions",
            json={"model": "m", "stream": True, "max_tokens": 10},
            headers={"x-request-id": rid, **headers},
        )


def _start(url: str, rid: str, results: dict, **headers: str) -> threading.Thread:
    thread = threading.Thread(target=_post, args=(url, rid, results), kwargs=headers)
    thread.start()
    return thread


def test_requests_beyond_max_in_flight_wait_and_their_wait_is_reported(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url, max_in_flight=1)
    results: dict[str, httpx.Response] = {}
    with hold_slot(gw.url, "first"):
        second = _start(gw.url, "second", results)
        assert wait_until(lambda: gw.gateway.queue.depth == 1)
        with httpx.Client() as client:
            metrics = client.get(gw.url + "/metrics").text
        assert "chunkledger_gateway_admission_queue_depth 1.0" in metrics
        assert "chunkledger_gateway_in_flight_requests 1.0" in metrics
        time.sleep(0.5)
    second.join(10)
    assert results["second"].status_code == 200
    assert wait_until(lambda: sum(isinstance(e, Admitted) for e in fake_ledger.store.events) == 2)
    enq = next(
        e for e in fake_ledger.store.events if isinstance(e, AdmissionEnqueued) and e.request_id == "second"
    )
    assert enq.queue_depth == 0  # nobody waited ahead of it
    admitted = {e.request_id: e for e in fake_ledger.store.events if isinstance(e, Admitted)}
    assert admitted["first"].wait_s == 0.0
    assert 0.5 <= admitted["second"].wait_s < 10  # admitted when the first one's client left
    assert gw.gateway.registry.get_sample_value("chunkledger_gateway_admission_wait_seconds_count") == 2


def test_full_queue_is_429_and_a_long_wait_is_503_both_with_retry_after(upstream, make_gateway, fake_ledger):
    gw = make_gateway(
        upstream.url,
        ledger_url=fake_ledger.url,
        max_in_flight=1,
        max_queue=1,
        max_queue_wait_s=0.5,
        retry_after_s=3,
    )
    results: dict[str, httpx.Response] = {}
    with hold_slot(gw.url):
        waiter = _start(gw.url, "waiter", results)
        assert wait_until(lambda: gw.gateway.queue.depth == 1)
        _post(gw.url, "refused", results)  # refused at once (429), not after waiting (503)
        waiter.join(10)
    full, late = results["refused"], results["waiter"]
    assert full.status_code == 429 and full.headers["retry-after"] == "3"
    assert full.json()["error"]["type"] == "rate_limit_error"
    assert "admission queue is full" in full.json()["error"]["message"]
    assert late.status_code == 503 and late.headers["retry-after"] == "3"
    assert "waited 0.5 s" in late.json()["error"]["message"]

    def statuses():
        return {e.request_id: e.status_code for e in fake_ledger.store.events if isinstance(e, Completed)}

    assert wait_until(lambda: len(statuses()) == 2)
    assert statuses() == {"waiter": 503, "refused": 429}
    finished = gw.gateway.registry.get_sample_value
    assert finished("chunkledger_gateway_requests_finished_total", {"outcome": "rejected_queue_full"}) == 1
    assert finished("chunkledger_gateway_requests_finished_total", {"outcome": "rejected_wait_timeout"}) == 1
    assert [r.request_id for r in upstream.app.requests] == ["holder"]


def test_priority_header_orders_the_waiting_requests(upstream, make_gateway):
    gw = make_gateway(upstream.url, max_in_flight=1)
    results: dict[str, httpx.Response] = {}
    threads = []
    with hold_slot(gw.url):
        for rid, priority in [("batch", "10"), ("interactive", "-5")]:
            threads.append(_start(gw.url, rid, results, **{"x-priority": priority}))
            assert wait_until(lambda n=len(threads): gw.gateway.queue.depth == n)
    for t in threads:
        t.join(10)
    assert [r.request_id for r in upstream.app.requests] == ["holder", "interactive", "batch"]
    assert results["batch"].status_code == results["interactive"].status_code == 200


def test_a_client_that_leaves_while_queued_gives_its_place_back(upstream, make_gateway, fake_ledger):
    gw = make_gateway(upstream.url, ledger_url=fake_ledger.url, max_in_flight=1)
    body = json.dumps({"model": "m", "stream": True}).encode()
    with hold_slot(gw.url):
        with socket.create_connection(("127.0.0.1", gw.server.port)) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"x-request-id: impatient\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            assert wait_until(lambda: gw.gateway.queue.depth == 1)
        assert wait_until(lambda: gw.gateway.queue.depth == 0)
        assert gw.gateway.queue.in_flight == 1  # the holder still streams
    assert [r.request_id for r in upstream.app.requests] == ["holder"]
    gw.flush()
    assert kinds_of(fake_ledger, "impatient") == ["arrived", "admission_enqueued", "client_disconnected"]
    assert gw.gateway.queue.in_flight == 0
