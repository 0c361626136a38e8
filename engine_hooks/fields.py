"""One field order per engine event kind, shared by every source that emits it positionally.

``exporter.emitter(Chunk, *CHUNK_FIELDS)`` takes a chunk's values in this order; the vLLM plugin
(:mod:`engine_hooks.vllm.reporter`) and the fleet simulator (:mod:`engine_hooks.simulator`) both emit
through these, so a row built by one reads the same as a row built by the other. The order is a
convention of the emitting side only: on the wire every field is named (:mod:`engine_hooks.events`).
"""

from __future__ import annotations

QUEUED_FIELDS = ("ts", "request_id", "prompt_tokens", "max_tokens", "arrival_ts", "priority")
CHUNK_FIELDS = (
    "ts",
    "request_id",
    "step",
    "tokens",
    "computed_before",
    "recomputed_tokens",
    "cached_tokens",
    "kv_blocks",
    "preemptions",
    "wait_s",
)
TOKENS_FIELDS = ("ts", "request_id", "count", "total", "first_ts", "kv_blocks", "token_ids")
PREEMPTED_FIELDS = ("ts", "request_id", "kv_blocks_freed", "computed_tokens")
RESUMED_FIELDS = ("ts", "request_id", "wait_s", "cached_tokens", "output_tokens")
FINISHED_FIELDS = ("ts", "request_id", "reason", "output_tokens", "stop_reason", "wait_s")
CUTOFF_APPLIED_FIELDS = ("ts", "request_id", "command_id", "action", "rule")
STEP_FIELDS = (
    "ts",
    "step",
    "duration_s",
    "prefill_tokens",
    "decode_tokens",
    "num_prefill_reqs",
    "num_decode_reqs",
    "running",
    "waiting",
    "kv_usage",
    "request_ids",
    "prefill_depth_tokens",
    "max_prefill_depth",
    "stalled_request_ids",
    "stalled_kv_blocks",
    "token_counts",
    "token_totals",
    "token_ids",
)

__all__ = [
    "CHUNK_FIELDS",
    "CUTOFF_APPLIED_FIELDS",
    "FINISHED_FIELDS",
    "PREEMPTED_FIELDS",
    "QUEUED_FIELDS",
    "RESUMED_FIELDS",
    "STEP_FIELDS",
    "TOKENS_FIELDS",
]
