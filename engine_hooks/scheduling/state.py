"""The scheduler's state: per-request counters, the running list, the waiting queue and the KV pool.

Requests are indices into columns (numpy arrays, and lists where the waiting queue reads its keys).
A caller either gives every request up front (the what-if replay: its whole trace, queued as each
arrives) or adds them as they come (:meth:`SchedulerState.add`, the simulator); a finished or aborted
request's index is reused by a later one.

A running request's KV is ``ceil(computed / block_size)`` blocks, its prefix-cache hit included: a hit
is counted as blocks the request holds, as if nobody else held them (vLLM shares a cached block between
the requests that hit it, and counts a hit on a free cached block as taken from the free pool; the
model cannot tell which, so it takes the latter, which over-counts KV in use when running requests
share a prefix). A waiting request holds no KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine_hooks.scheduling.queues import make_queue
from engine_hooks.scheduling.settings import VLLM, Departures, EngineSettings

# the per-request columns, grown together when requests are added past the arrays' size
_COLUMNS = ("prompt", "cached", "arrival", "priority", "comp", "ntok", "chunking", "last_active", "preempts")


class SchedulerState:
    """What one engine's scheduler knows and changes as it steps (see the module docstring)."""

    def __init__(
        self,
        settings: EngineSettings,
        departures: Departures = VLLM,
        *,
        prompt: Sequence[int] = (),
        cached: Sequence[int] = (),
        arrival: Sequence[float] = (),
        priority: Sequence[int] = (),
        request_id: Sequence[str] = (),
    ):
        n = len(prompt)
        self.settings = settings
        self.departures = departures
        self.bs = settings.block_size
        self.total_blocks = settings.num_kv_blocks
        self.used = 0  # KV blocks in use
        self.prompt = np.array(prompt, dtype=np.int64)
        self.cached = np.array(cached, dtype=np.int64)  # the prefix-cache hit at its next admission
        self.arrival = np.array(arrival, dtype=np.float64)
        self.priority = np.array(priority if len(priority) else [0] * n, dtype=np.int64)  # smaller first
        self.comp = np.zeros(n, dtype=np.int64)  # computed tokens (while running)
        self.ntok = self.prompt.copy()  # prompt + generated tokens (vLLM's num_tokens)
        self.chunking = np.zeros(n, dtype=bool)  # vLLM's is_prefill_chunk (last chunk non-final)
        self.last_active = self.arrival.copy()  # the caller's mark of the last step it ran in (kv-idle)
        self.preempts = np.zeros(n, dtype=np.int64)
        self.active = np.ones(n, dtype=bool)  # a request of this index is waiting or running
        # the waiting queue's keys, as lists (cheaper to read one at a time than numpy arrays)
        self.prompt_list: list[int] = self.prompt.tolist()
        self.arrival_list: list[float] = self.arrival.tolist()
        self.priority_list: list[int] = self.priority.tolist()
        self.request_id: list[str] = list(request_id) or [""] * n
        self.run = np.zeros(0, dtype=np.int64)  # the running list, in vLLM's order
        self.queue = make_queue(
            settings.policy,
            settings.admission_reserve > 0,
            float(settings.admission_aging_s),
            self.prompt_list,
            self.arrival_list,
            self.priority_list,
            self.request_id,
        )
        self._size = n  # indices in use or given up front (the columns may be longer)
        self._reusable: list[int] = []  # indices of finished requests, for the next ones added

    @property
    def free(self) -> int:
        return self.total_blocks - self.used

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.bs)

    def add(self, prompt: int, cached: int, arrival: float, priority: int = 0, request_id: str = "") -> int:
        """A request arrives: queued at the back of the waiting queue; returns its index."""
        if self._reusable:
            i = self._reusable.pop()
        else:
            i = self._size
            self._size += 1
            if i == len(self.prompt):
                self._grow(max(16, 2 * i))
            self.prompt_list.append(prompt)
            self.arrival_list.append(arrival)
            self.priority_list.append(priority)
            self.request_id.append(request_id)
        self.prompt_list[i], self.arrival_list[i] = prompt, arrival
        self.priority_list[i], self.request_id[i] = priority, request_id
        self.prompt[i] = self.ntok[i] = prompt
        self.cached[i], self.arrival[i], self.priority[i] = cached, arrival, priority
        self.comp[i] = self.preempts[i] = 0
        self.chunking[i] = False
        self.last_active[i] = arrival
        self.active[i] = True
        self.queue.add(i)
        return i

    def _grow(self, size: int) -> None:
        for name in (*_COLUMNS, "active"):
            old = getattr(self, name)
            new = np.zeros(size, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def preempt(self, i: int, held_tokens: int) -> None:
        """Preempt running request ``i`` (already out of the running list) holding KV for
        ``held_tokens``: its blocks are freed, its computed tokens lost, it waits at the front."""
        self.used -= self.blocks(held_tokens)
        self.comp[i] = 0
        self.chunking[i] = False
        self.preempts[i] += 1
        if self.departures.recompute_all_on_resume:
            self.cached[i] = 0
        self.queue.add_preempted(i)

    def release(self, idx: np.ndarray) -> None:
        """Running requests ``idx`` finished: their KV is freed and they leave the running list."""
        self.used -= int(((self.comp[idx] + self.bs - 1) // self.bs).sum())
        self.active[idx] = False
        self.run = self.run[self.active[self.run]]
        self._reusable.extend(idx.tolist())

    def abort(self, i: int) -> None:
        """Request ``i`` ends where it is (running or waiting): as :meth:`release`, or out of the queue."""
        if self.running(i):
            self.release(np.asarray([i], dtype=np.int64))
            return
        self.queue.remove(i)
        self.active[i] = False
        self._reusable.append(i)

    def running(self, i: int) -> bool:
        """Whether request ``i`` is in the running list."""
        return bool(np.count_nonzero(self.run == i))


__all__ = ["SchedulerState"]
