"""The admission queue: at most ``max_in_flight`` requests upstream, the rest wait in order.

Order: lower ``priority`` first, FIFO within a priority (a heap keyed by ``(priority, arrival number)``).
Bounds: a request that finds ``max_queue`` others waiting is refused at once (:class:`QueueFull`, the
gateway answers 429); one that waits longer than ``max_wait_s`` is refused then (:class:`QueueTimeout`,
503). Both carry a ``retry_after_s`` hint.

Everything runs on the event loop thread, so there are no locks. A slot freed by ``release()`` is
handed straight to the next live waiter (its future gets the slot), so ``in_flight`` never dips
below the number of requests actually holding a slot and no late arrival can overtake a waiter.
Waiters that time out or are cancelled (client gone, request cut) are marked dead and skipped when
they reach the top of the heap (lazy deletion), so leaving costs O(1).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field


class AdmissionRefused(Exception):
    """The request was not admitted; ``status`` is the HTTP status the gateway answers with."""

    status = 503
    reason = "refused"

    def __init__(self, message: str, retry_after_s: float, waited_s: float = 0.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.waited_s = waited_s


class QueueFull(AdmissionRefused):
    status = 429
    reason = "queue_full"


class QueueTimeout(AdmissionRefused):
    status = 503
    reason = "wait_timeout"


@dataclass(order=True)
class _Waiter:
    priority: int
    number: int
    future: asyncio.Future[None] = field(compare=False)
    dead: bool = field(default=False, compare=False)


class AdmissionQueue:
    """At most ``max_in_flight`` holders; ``max_queue`` waiters for at most ``max_wait_s`` each."""

    def __init__(self, max_in_flight: int, max_queue: int, max_wait_s: float, retry_after_s: float = 1.0):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, got {max_queue}")
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be positive, got {max_wait_s}")
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0  # slots held (requests forwarded upstream and not yet done)
        self.waiting = 0  # live waiters in the heap
        self._heap: list[_Waiter] = []
        self._numbers = itertools.count()

    @property
    def depth(self) -> int:
        """Requests waiting for a slot now."""
        return self.waiting

    async def acquire(self, priority: int = 0) -> float:
        """Wait for a slot; returns the monotonic seconds waited. Raises AdmissionRefused subclasses.

        A caller that is cancelled while waiting leaves the queue (and gives back a slot it was just
        handed); one that returns holds a slot and must call ``release()`` exactly once.
        """
        if self.in_flight < self.max_in_flight and not self.waiting:
            self.in_flight += 1
            return 0.0
        if self.waiting >= self.max_queue:
            raise QueueFull(
                f"the admission queue is full ({self.waiting} requests waiting for "
                f"{self.max_in_flight} upstream slots)",
                self.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(priority, next(self._numbers), loop.create_future())
        heapq.heappush(self._heap, waiter)
        self.waiting += 1
        started = time.monotonic()
        timer = loop.call_later(self.max_wait_s, self._expire, waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release()  # handed a slot in the same loop turn as the cancellation
            else:
                self._leave(waiter)
            raise
        finally:
            timer.cancel()
        waited = time.monotonic() - started
        return waited

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._leave(waiter)
        waited = self.max_wait_s
        waiter.future.set_exception(
            QueueTimeout(
                f"waited {waited:.3g} s in the admission queue (limit {self.max_wait_s:g} s) without an "
                f"upstream slot",
                self.retry_after_s,
                waited,
            )
        )

    def _leave(self, waiter: _Waiter) -> None:
        if not waiter.dead:
            waiter.dead = True
            self.waiting -= 1

    def release(self) -> None:
        """Give a slot back: to the next live waiter, or to the pool."""
        heap = self._heap
        while heap:
            waiter = heapq.heappop(heap)
            if waiter.dead:
                continue
            waiter.dead = True
            self.waiting -= 1
            waiter.future.set_result(None)  # the slot moves to it: in_flight is unchanged
            return
        self.in_flight -= 1
