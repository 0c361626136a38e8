"""Settings of the vLLM plugin's optional scheduling policies (all off by default).

Every setting has an environment variable ``CHUNKLEDGER_VLLM_<NAME>`` (upper case) and a key in
vLLM's ``additional_config`` under ``"chunkledger"`` (which wins), e.g.
``--additional-config '{"chunkledger": {"admission_reserve": 0.25}}'``. Invalid values raise
:class:`engine_hooks.config.ConfigError` naming the variable or key.

Depends on msgspec only (no vLLM import), so it can be tested and documented without an engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from engine_hooks.config import ConfigError
from engine_hooks.settings import convert, from_environ, is_bool_field, parse_bool

ENV_PREFIX = "CHUNKLEDGER_VLLM_"

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Share = Annotated[float, msgspec.Meta(ge=0, lt=1)]


class LedgerOptions(msgspec.Struct, kw_only=True, frozen=True):
    """Scheduling options of :class:`engine_hooks.vllm.LedgerScheduler`."""

    # -- preemption -------------------------------------------------------------------------------
    kv_idle_victim: bool = False  # preempt the request whose KV has sat idle longest (among those
    # not yet scheduled this step) instead of vLLM's last running one; FCFS policy only
    preempt_escape_after: NonNegInt = 0  # after this many preemptions a request is not chosen as a
    # victim, like non_preemptible, for as long as preempt_escape_for says (0: off)
    preempt_escape_for: Literal["finish", "predicted"] = "finish"  # "finish": until it finishes;
    # "predicted": for its predicted remaining output (engine_hooks.vllm.predict.OutputLengths: the p90
    # of the output lengths, of the last 1024 requests this engine finished by stop or length, longer
    # than what it has produced, at most its max_tokens; until it finishes while fewer than 8 have
    # finished), then it is preemptible again, and protected again after another preempt_escape_after
    # preemptions

    # -- admission reserve ------------------------------------------------------------------------
    admission_reserve: Share = 0.0  # most of the token budget kept, in every step, for the other
    # requests that can run in it: running prefill chunks leave min(share * budget, demand), demand
    # being the running decodes' tokens and the prompts of waiting requests that have a free slot and
    # fit the free KV cache, in vLLM's order (0: off)
    admission_aging_s: NonNegFloat = 2.0  # within the reserve, waiting requests are admitted shortest
    # prompt first, except preempted ones and those queued longer than this, which go first in
    # arrival order
    admission_depth_tokens: NonNegInt = 0  # with the reserve on and other requests running in the
    # step, a running prefill chunk at depth d is capped at (budget - demand) / (1 + d / this),
    # so a deep chunk (whose attention cost grows with d) does not make their step long (0: no depth cap)
    admission_step_target_s: NonNegFloat = 0.0  # with the reserve on, a prefill chunk is also capped
    # so that the step's predicted duration stays within this many seconds, predicted from the
    # engine's own measured steps (engine_hooks.vllm.predict.StepTimes: an online least-squares fit
    # over tokens, attention work and chunk depth, recent steps weighted most; no cap until it has
    # seen 8 steps), in every step: also when the prefill runs alone, since a request arriving during
    # a step waits for it to end (0: off; needs admission_reserve)
    admission_arrivals_first: bool = False  # with the reserve on: a step that admits waiting short
    # prompts (at most half the budget each) leaves the largest running prefill out (its KV kept),
    # never two steps in a row, so an arrival waits for the step it arrived in and its own short one
    admission_min_chunk: Annotated[int, msgspec.Meta(ge=1)] = 64  # the caps never go below this, nor
    # below another prefill that runs whole in the step (a short prompt is never split by the cap)

    # -- commands ---------------------------------------------------------------------------------
    slow_pool_every: Annotated[int, msgspec.Meta(ge=1)] = 4  # a slow_pool request that got no token
    # for this many steps is scheduled first once (its guaranteed progress)

    # -- events -----------------------------------------------------------------------------------
    step_tokens: bool = False  # output tokens ride on the step event, one column entry per request
    # that ran (schema 2: one event per step, a third fewer bytes); off: per-request tokens events
    # (tokens_flush), which today's ledger folds with less CPU per token (docs/benchmarks.md)
    tokens_flush: Annotated[int, msgspec.Meta(ge=1)] = 16  # output tokens coalesced per tokens event
    tokens_flush_s: NonNegFloat = 0.05  # longest a produced token waits for its tokens event (one is
    # also sent at finish and at preemption)
    token_ids: bool = True  # send output token ids (for the loop detector)

    @property
    def reorders(self) -> bool:
        """Whether any option changes what vLLM would schedule."""
        return bool(self.kv_idle_victim or self.preempt_escape_after or self.admission_reserve)

    @classmethod
    def from_sources(
        cls, environ: Mapping[str, str] | None = None, extra: Mapping[str, Any] | None = None
    ) -> LedgerOptions:
        """Options from ``CHUNKLEDGER_VLLM_*`` variables, then ``extra`` (additional_config) on top."""
        env = os.environ if environ is None else environ
        raw, names = from_environ(cls, ENV_PREFIX, env, _parse_env_value)
        fields = set(cls.__struct_fields__)
        for key, value in (extra or {}).items():
            if key not in fields:
                known = ", ".join(sorted(fields))
                raise ConfigError(f"additional_config.chunkledger.{key}: unknown option (known: {known})")
            raw[key] = value
            names[key] = f"additional_config.chunkledger.{key}"
        opts = convert(cls, raw, names, what="chunkledger vLLM option", error=ConfigError)
        for name in _NEED_RESERVE:
            if getattr(opts, name) and not opts.admission_reserve:
                shown = names.get(name, name)
                raise ConfigError(
                    f"{shown}: works with the admission reserve only; set admission_reserve too "
                    f"(got {raw.get(name)!r} with admission_reserve 0)"
                )
        return opts


# options that do nothing without admission_reserve
_NEED_RESERVE = ("admission_step_target_s", "admission_arrivals_first")


def _parse_env_value(name: str, var: str, value: str) -> Any:
    """Booleans parsed here (an empty value is false); numbers are left to msgspec's lax conversion."""
    return parse_bool(var, value, ConfigError, empty=False) if is_bool_field(LedgerOptions, name) else value


__all__ = ["LedgerOptions"]
