"""chunkledger's vLLM v1 plugin: a scheduler subclass that reports every engine step to the ledger.

    vllm serve MODEL --scheduler-cls engine_hooks.vllm.LedgerScheduler     (CHUNKLEDGER_URL set)
    LLM(model, scheduler_cls="engine_hooks.vllm.LedgerScheduler", ...)

``engine_hooks.vllm.tiny_model`` builds a random-weight model for running vLLM offline. Importing this
package does not import vLLM; the scheduler classes are loaded on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "LedgerScheduler": "engine_hooks.vllm.scheduler",
    "AsyncLedgerScheduler": "engine_hooks.vllm.scheduler",
    "build_tiny_model": "engine_hooks.vllm.tiny_model",
    "vllm_env": "engine_hooks.vllm.tiny_model",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["AsyncLedgerScheduler", "LedgerScheduler", "build_tiny_model", "vllm_env"]
