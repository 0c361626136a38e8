"""The what-if model's inputs: recorded requests and a step's shape (the engine settings to try are
the scheduling model's, :class:`engine_hooks.scheduling.settings.EngineSettings`).

Pure data, no numpy: :class:`TraceRequest` is a frozen dataclass that checks itself (``ValueError``
naming the field and the reason); :class:`StepShape` is what a step's duration depends on, with the
names of the ledger's step columns, handed to the caller's step-cost model (a fitted one in
production, a simple function in tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One recorded request, as the replay needs it.

    ``cached_tokens`` is the prefix-cache hit at its first schedule (tokens vLLM took from the cache
    instead of computing): a multiple of the block size, never the whole prompt (vLLM always computes
    at least the last prompt token). ``output_tokens`` is what it produced (at least 1: the request
    finishes with its ``output_tokens``-th token). ``priority`` is vLLM's (smaller runs first) and
    matters under the ``"priority"`` policy only.
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    priority: int = 0

    def __post_init__(self) -> None:
        who = f"request {self.request_id!r}"
        if not math.isfinite(self.arrival_s):
            raise ValueError(f"{who}: arrival_s must be a finite number of seconds (got {self.arrival_s!r})")
        if self.prompt_tokens < 1:
            raise ValueError(f"{who}: prompt_tokens must be at least 1 (got {self.prompt_tokens})")
        if not 0 <= self.cached_tokens < self.prompt_tokens:
            raise ValueError(
                f"{who}: cached_tokens must be in [0, prompt_tokens): vLLM always computes the last "
                f"prompt token (got {self.cached_tokens} of {self.prompt_tokens})"
            )
        if self.output_tokens < 1:
            raise ValueError(f"{who}: output_tokens must be at least 1 (got {self.output_tokens})")


class StepShape(NamedTuple):
    """What one step's duration depends on (the ledger's step columns of the same names).

    ``prefill_depth_tokens`` is the sum over the step's prefill chunks of chunk tokens x tokens computed
    before the chunk (its attention work that grows with depth); ``max_prefill_depth`` the deepest
    chunk start; ``kv_usage`` the share of KV blocks in use after the step's allocations (0..1).
    A NamedTuple rather than a dataclass: the replay makes one per step, and it is cheaper to build.
    """

    prefill_tokens: int
    prefill_depth_tokens: int
    max_prefill_depth: int
    num_prefill_reqs: int
    num_decode_reqs: int
    kv_usage: float


StepCost = Callable[[StepShape], float]
"""Seconds one step of that shape takes (the caller's fitted step-time model)."""


__all__ = ["StepCost", "StepShape", "TraceRequest"]
