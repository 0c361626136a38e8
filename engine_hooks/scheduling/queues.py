"""The waiting queue of the scheduling model, in the order vLLM (and the plugin) would admit from it.

Requests are the state's indices (:mod:`engine_hooks.scheduling.state`). Three orders:

* :class:`FcfsQueue`: vLLM's FCFS queue, a deque: arrivals at the back, preempted requests pushed to
  the front (the last one preempted first).
* :class:`PriorityQueue`: vLLM's priority queue: by (priority, arrival, request id), preempted
  requests included (vLLM's heap has no front).
* :class:`ReserveQueue`: FCFS with the plugin's admission reserve on (``_cl_order_waiting``): first
  the aged requests (preempted ones, and those queued ``admission_aging_s`` or longer) by arrival,
  then the others shortest prompt first. The plugin sorts vLLM's deque in place with a stable sort
  before every step; this keeps the two groups sorted instead, with ties broken by arrival order.
  That is the plugin's order except between requests with the very same arrival time, where the
  plugin keeps whatever order the queue had.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Iterator, Sequence


class WaitingQueue:
    """The interface the scheduler uses (see the module docstring for the orders)."""

    def add(self, i: int) -> None:
        """A request arrives."""
        raise NotImplementedError

    def add_preempted(self, i: int) -> None:
        """A request was preempted (it goes back to waiting)."""
        raise NotImplementedError

    def head(self) -> int:
        """The request vLLM would try to admit next (the queue is not empty)."""
        raise NotImplementedError

    def pop(self) -> int:
        """Remove and return :meth:`head`."""
        raise NotImplementedError

    def remove(self, i: int) -> None:
        """Take a waiting request out (it was aborted); ValueError when it is not waiting."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[int]:
        raise NotImplementedError

    def prepare(self, now: float) -> None:
        """Before a step that starts at ``now``: reorder as the policy does at that time."""

    def would_change(self, now: float) -> bool:
        """Whether :meth:`prepare` at ``now`` would change the order (the fast-forward stops there)."""
        return False


class FcfsQueue(WaitingQueue):
    """vLLM's FCFS waiting queue."""

    def __init__(self) -> None:
        self._q: deque[int] = deque()

    def add(self, i: int) -> None:
        self._q.append(i)

    def add_preempted(self, i: int) -> None:
        self._q.appendleft(i)

    def head(self) -> int:
        return self._q[0]

    def pop(self) -> int:
        return self._q.popleft()

    def remove(self, i: int) -> None:
        self._q.remove(i)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[int]:
        return iter(self._q)


class PriorityQueue(WaitingQueue):
    """vLLM's priority waiting queue: smallest (priority, arrival, request id) first."""

    def __init__(self, priority: Sequence[int], arrival: Sequence[float], request_id: Sequence[str]):
        self._prio = priority
        self._arrival = arrival
        self._rid = request_id
        self._keys: list[tuple[int, float, str, int]] = []

    def _key(self, i: int) -> tuple[int, float, str, int]:
        return (self._prio[i], self._arrival[i], self._rid[i], i)

    def add(self, i: int) -> None:
        bisect.insort(self._keys, self._key(i))

    add_preempted = add

    def head(self) -> int:
        return self._keys[0][3]

    def pop(self) -> int:
        return self._keys.pop(0)[3]

    def remove(self, i: int) -> None:
        self._keys.remove(self._key(i))

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[int]:
        return (k[3] for k in self._keys)


class ReserveQueue(WaitingQueue):
    """The plugin's admission-reserve order over vLLM's FCFS queue (aged by arrival, then shortest)."""

    def __init__(self, prompt: Sequence[int], arrival: Sequence[float], aging_s: float):
        self._prompt = prompt
        self._arrival = arrival
        self._aging = aging_s
        self._aged: list[tuple[float, int]] = []  # (arrival, i), sorted
        self._fresh: list[tuple[int, int]] = []  # (prompt tokens, i), sorted
        self._ageing: list[tuple[float, int]] = []  # heap (arrival, i) of the fresh ones (lazy)
        self._is_fresh: set[int] = set()

    def add(self, i: int) -> None:
        bisect.insort(self._fresh, (self._prompt[i], i))
        heapq.heappush(self._ageing, (self._arrival[i], i))
        self._is_fresh.add(i)

    def add_preempted(self, i: int) -> None:
        bisect.insort(self._aged, (self._arrival[i], i))

    def head(self) -> int:
        return self._aged[0][1] if self._aged else self._fresh[0][1]

    def pop(self) -> int:
        if self._aged:
            return self._aged.pop(0)[1]
        i = self._fresh.pop(0)[1]
        self._is_fresh.discard(i)
        return i

    def remove(self, i: int) -> None:
        if i in self._is_fresh:
            self._is_fresh.discard(i)
            self._fresh.remove((self._prompt[i], i))
        else:
            self._aged.remove((self._arrival[i], i))

    def __len__(self) -> int:
        return len(self._aged) + len(self._fresh)

    def __iter__(self) -> Iterator[int]:
        for _, i in self._aged:
            yield i
        for _, i in self._fresh:
            yield i

    def _drop_stale(self) -> None:
        """Drop the ageing heap's entries of requests no longer fresh (left lazily by :meth:`pop`), and
        of an index since reused by a request that arrived at another time."""
        heap, fresh, arrival = self._ageing, self._is_fresh, self._arrival
        while heap and (heap[0][1] not in fresh or arrival[heap[0][1]] != heap[0][0]):
            heapq.heappop(heap)

    def prepare(self, now: float) -> None:
        heap = self._ageing
        self._drop_stale()
        while heap and now - heap[0][0] >= self._aging:  # the plugin's test: now - queued_t >= aging
            arrival, i = heapq.heappop(heap)
            self._is_fresh.discard(i)
            at = bisect.bisect_left(self._fresh, (self._prompt[i], i))
            del self._fresh[at]
            bisect.insort(self._aged, (arrival, i))
            self._drop_stale()

    def would_change(self, now: float) -> bool:
        self._drop_stale()
        heap = self._ageing
        return bool(heap) and now - heap[0][0] >= self._aging


def make_queue(
    policy: str,
    reserve: bool,
    aging_s: float,
    prompt: Sequence[int],
    arrival: Sequence[float],
    priority: Sequence[int],
    request_id: Sequence[str],
) -> WaitingQueue:
    """The waiting queue for ``policy`` (the plugin only reorders vLLM's FCFS deque, not its heap)."""
    if policy == "priority":
        return PriorityQueue(priority, arrival, request_id)
    if reserve:
        return ReserveQueue(prompt, arrival, aging_s)
    return FcfsQueue()


__all__ = ["FcfsQueue", "PriorityQueue", "ReserveQueue", "WaitingQueue", "make_queue"]
