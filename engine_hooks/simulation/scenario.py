"""The simulated fleet's knobs (``Scenario``, the named ``SCENARIOS``) and one simulated request."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from engine_hooks.events import Command
from engine_hooks.scheduling.settings import EngineSettings

BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Scenario:
    """Knobs of one simulated fleet; ``SCENARIOS`` holds the named presets."""

    prompt_median: int = 600
    prompt_sigma: float = 0.9
    long_prompt_p: float = 0.01  # share of prompts of 4k-12k tokens
    very_long_prompt_p: float = 0.002  # share of 20k-token prompts
    very_long_prompt_tokens: int = 20_000
    output_median: int = 180
    output_sigma: float = 0.8
    max_tokens: int = 2048  # client cap on ordinary requests
    runaway_p: float = 0.003  # share of requests with no cap and no stop that loop
    runaway_cap: int = 6000  # the simulator's own hard stop for runaways
    prefix_hit_p: float = 0.3  # share of requests with a prefix-cache hit
    disconnect_p: float = 0.005  # share of clients that go away mid-stream
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0  # 0: no per-request cap per step
    kv_blocks: int = 16_384  # KV cache size per engine, in 16-token blocks
    step_a_s: float = 0.004  # fixed cost of a step
    step_b_s: float = 12e-6  # per prefill token
    step_c_s: float = 8e-10  # per prefill token per token of depth (attention over the prefix)
    step_d_s: float = 40e-6  # per decode request
    step_tokens: bool = False  # output tokens ride on the step event (schema 2), the plugin's step_tokens
    tokens_flush: int = 16  # output tokens coalesced per tokens event (with step_tokens off)
    gateway_entry_s: float = 0.002  # parsing, auth, tokenising at the gateway

    def engine_settings(self) -> EngineSettings:
        """The engine configuration each simulated engine schedules under (chunked prefill on; a
        request is admitted when its first chunk fits the free KV: ``reserve_full_isl`` off)."""
        return EngineSettings(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            num_kv_blocks=self.kv_blocks,
            block_size=BLOCK_TOKENS,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            reserve_full_isl=False,
        )


SCENARIOS: dict[str, Scenario] = {
    "steady": Scenario(),
    "long-prompts": Scenario(long_prompt_p=0.05, very_long_prompt_p=0.02),
    "kv-pressure": Scenario(kv_blocks=2048, output_median=400),
    "runaway": Scenario(runaway_p=0.05),
    "chunk-threshold": Scenario(very_long_prompt_p=0.02, long_prefill_token_threshold=256),
}


@dataclass(eq=False)
class SimRequest:
    """One simulated request: what the fleet drew for it and what its engine reported so far. Its
    scheduling counters (tokens computed, KV blocks, preemptions) are its engine's scheduler's, at
    ``slot``."""

    id: str
    prompt_tokens: int
    max_tokens: int | None
    target_output: int
    cached_tokens: int
    runaway: bool
    disconnect_at: int | None  # output token count at which the client goes away
    arrived_t: float
    slot: int = -1  # its index in its engine's scheduler state
    queued_t: float = 0.0
    output: int = 0
    chunks: int = 0
    waiting_since: float = 0.0
    lost_tokens: int = 0  # computed tokens thrown away by preemptions (recomputed on resume)
    first_token_t: float | None = None
    pending_ids: list[int] = field(default_factory=list)
    pending_first_t: float | None = None
    finished: bool = False
    cutoff: Command | None = None

    def prefilling(self, computed: int) -> bool:
        """Whether a pass from ``computed`` tokens is a prefill chunk (first pass, or recompute after a
        preemption) rather than a decode.

        In decode, every token but the last sampled one is computed (vLLM's num_computed_tokens is
        num_tokens - 1), so a prefill is any pass that starts further behind than that."""
        return computed < self.prompt_tokens + max(self.output - 1, 0)

    def next_token(self, rng: random.Random) -> int:
        if self.runaway:
            return (101, 2023, 318)[self.output % 3]
        return rng.randrange(100, 50_000)


def _new_prompt_tokens(req: SimRequest, computed: int, n: int) -> int:
    """Of a chunk of ``n`` tokens after ``computed``, the prompt positions never computed before.

    Everything else in the chunk is recomputation: positions a preemption threw away, and output
    positions (past the prompt) that decode had already computed.
    """
    high = max(min(req.lost_tokens, req.prompt_tokens), computed)
    return max(0, min(computed + n, req.prompt_tokens) - high)
