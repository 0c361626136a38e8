"""The what-if model's inputs: recorded requests, the engine settings to try, and a step's shape.

Pure data, no numpy: :class:`TraceRequest` and :class:`EngineSettings` are frozen dataclasses that
check themselves (``ValueError`` naming the field and the reason); :class:`StepShape` is what a step's
duration depends on, with the names of the ledger's step columns, handed to the caller's step-cost
model (a fitted one in production, a simple function in tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import NamedTuple

POLICIES = ("fcfs", "priority", "kv-idle")


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


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The engine configuration to replay under (vLLM's names where vLLM has them).

    * ``max_num_batched_tokens``: the token budget of a step; ``max_num_seqs``: the running set's size
      limit; ``num_kv_blocks`` x ``block_size``: the KV cache; ``long_prefill_token_threshold``: cap on
      a prefill chunk when more than one request is running or waiting (0: none);
      ``enable_chunked_prefill``; ``reserve_full_isl``: vLLM 0.32's ``scheduler_reserve_full_isl``
      (on by default there), admit a waiting request only when its whole sequence fits the free KV.
    * ``policy``: ``"fcfs"`` (vLLM's default), ``"priority"`` (vLLM's priority scheduling), or
      ``"kv-idle"`` (FCFS with the chunkledger plugin's ``kv_idle_victim``).
    * ``admission_reserve``, ``admission_aging_s``: the plugin's admission reserve
      (:mod:`engine_hooks.vllm.options`); 0 is off. Its other options are not modelled.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int = 16
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    admission_reserve: float = 0.0
    policy: str = "fcfs"
    admission_aging_s: float = 2.0
    reserve_full_isl: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "num_kv_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an integer of at least 1 (got {value!r})")
        thr = self.long_prefill_token_threshold
        if not isinstance(thr, Integral) or isinstance(thr, bool) or thr < 0:
            raise ValueError(
                f"long_prefill_token_threshold: must be an integer >= 0, 0 for none (got {thr!r})"
            )
        share = self.admission_reserve
        if not (isinstance(share, Real) and 0.0 <= share < 1.0):
            raise ValueError(f"admission_reserve: must be a share in [0, 1) of the budget (got {share!r})")
        aging = self.admission_aging_s
        if not (isinstance(aging, Real) and 0.0 <= aging < math.inf):
            raise ValueError(f"admission_aging_s: must be a finite number of seconds >= 0 (got {aging!r})")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: unknown policy {self.policy!r} (known: {', '.join(POLICIES)})")


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


__all__ = ["POLICIES", "EngineSettings", "StepCost", "StepShape", "TraceRequest"]
