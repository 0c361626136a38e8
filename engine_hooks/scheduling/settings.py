"""What the scheduling model runs under: the engine configuration (:class:`EngineSettings`, vLLM's names
where vLLM has them) and the places where a caller's model departs from vLLM (:class:`Departures`).

Pure data: frozen dataclasses that check themselves (``ValueError`` naming the field and the reason).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

POLICIES = ("fcfs", "priority", "kv-idle")


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The engine configuration to schedule under (vLLM's names where vLLM has them).

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


@dataclass(frozen=True, slots=True)
class Departures:
    """Where a caller's model departs from vLLM 0.32; all off (:data:`VLLM`) is vLLM's behaviour.

    The fleet simulator was written with three of them and keeps them (:data:`SIMULATOR`), so that its
    event streams stay what they were; the what-if replay models vLLM.

    * ``admit_after_preemption``: a step whose running pass preempted somebody still runs the waiting
      pass (vLLM's ``schedule()`` admits nobody in such a step).
    * ``recompute_all_on_resume``: a preempted request recomputes its whole sequence when it comes back
      (vLLM looks the prefix cache up again: the model takes the request's recorded hit again).
    * ``victim_newest_arrival``: under FCFS the victim is the newest arrival (``arrival``) among the
      running requests not yet scheduled in the step, else the request being allocated (vLLM takes the
      last running request; the two differ only where running order is not arrival order).
    """

    admit_after_preemption: bool = False
    recompute_all_on_resume: bool = False
    victim_newest_arrival: bool = False


VLLM = Departures()
SIMULATOR = Departures(admit_after_preemption=True, recompute_all_on_resume=True, victim_newest_arrival=True)


__all__ = ["POLICIES", "SIMULATOR", "VLLM", "Departures", "EngineSettings"]
