"""The replay's mutable state: the scheduling model's (:class:`~engine_hooks.scheduling.state.
SchedulerState`: requests' counters, the running list, the waiting queue, the KV pool) with the trace
and the timing on top: outputs, token times, the clock and the samples.

Requests are indexed in arrival order (ties in the trace's order), all given up front and queued as
each arrives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from engine_hooks.scheduling.settings import VLLM, Departures, EngineSettings
from engine_hooks.scheduling.state import SchedulerState
from ledger.whatif.types import TraceRequest


class State(SchedulerState):
    """Everything the replay changes as it steps (see the module docstring)."""

    def __init__(
        self, requests: Sequence[TraceRequest], settings: EngineSettings, departures: Departures = VLLM
    ):
        order = sorted(range(len(requests)), key=lambda k: (requests[k].arrival_s, k))
        reqs = [requests[k] for k in order]
        super().__init__(
            settings,
            departures,
            prompt=[r.prompt_tokens for r in reqs],
            cached=[r.cached_tokens for r in reqs],
            arrival=[r.arrival_s for r in reqs],
            priority=[r.priority for r in reqs],
            request_id=[r.request_id for r in reqs],
        )
        self.order = np.asarray(order, dtype=np.int64)  # replay index -> position in the caller's list
        n = len(reqs)
        self.n = n
        self.out = np.fromiter((r.output_tokens for r in reqs), dtype=np.int64, count=n)
        self.gen = np.zeros(n, dtype=np.int64)  # generated tokens
        self.last_tok = np.full(n, np.nan)  # when its last token came
        self.first_tok = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.next_arrival = 0  # the next request not yet queued
        self.now = self.arrival_list[0] if n else 0.0
        self.steps = 0
        self.last_end = -math.inf  # when the last step ended (a step starting then follows it)
        self.last_first = 0  # first tokens the last step emitted (the loop processes them before the next)
        self.gaps: list[float] = []  # decode inter-token gaps (seconds) ...
        self.gap_weights: list[int] = []  # ... and how many tokens had each

    def next_arrival_s(self) -> float:
        k = self.next_arrival
        return self.arrival_list[k] if k < self.n else float("inf")

    def queue_arrivals(self) -> None:
        """Queue the requests that arrived by ``now`` (vLLM sees them at its next schedule())."""
        k, arrivals, now, queue = self.next_arrival, self.arrival_list, self.now, self.queue
        while k < self.n and arrivals[k] <= now:
            queue.add(k)
            k += 1
        self.next_arrival = k

    def validate(self) -> None:
        """Refuse requests the engine could never run (vLLM would stall on them for ever)."""
        s = self.settings
        odd = np.flatnonzero(self.cached % self.bs)
        if odd.size:
            i = int(odd[0])
            raise ValueError(
                f"request {self.request_id[i]!r}: cached_tokens {int(self.cached[i])} is not a multiple of "
                f"block_size {self.bs} (vLLM's prefix cache hits whole blocks)"
            )
        worst = self.prompt + self.out - 1  # tokens with KV when its last token is computed
        too_big = np.flatnonzero(-(-worst // self.bs) > self.total_blocks)
        if too_big.size:
            i = int(too_big[0])
            raise ValueError(
                f"request {self.request_id[i]!r}: {int(worst[i])} tokens (prompt + output - 1) need "
                f"{self.blocks(int(worst[i]))} KV blocks of {self.bs}, more than num_kv_blocks "
                f"{self.total_blocks}: it could never run (vLLM refuses such a max_model_len)"
            )
        if s.enable_chunked_prefill:
            return
        budget = s.max_num_batched_tokens
        first = self.prompt - self.cached
        bad = np.flatnonzero(first > budget)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"request {self.request_id[i]!r}: its prompt needs {int(first[i])} tokens computed in one "
                f"step, more than max_num_batched_tokens {budget} with chunked prefill off: vLLM could "
                "never schedule it (it requires max_num_batched_tokens >= max_model_len without "
                "chunked prefill)"
            )
        resume = worst - self.cached
        bad = np.flatnonzero(resume > budget)
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"request {self.request_id[i]!r}: after a preemption it may have to recompute "
                f"{int(resume[i])} tokens in one step, more than max_num_batched_tokens {budget} with "
                "chunked prefill off: vLLM could not resume it (it requires max_num_batched_tokens >= "
                "max_model_len without chunked prefill)"
            )


__all__ = ["State"]
