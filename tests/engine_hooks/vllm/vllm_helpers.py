"""Helpers for the real-vLLM tests: driving an in-process engine step by step, and reading events."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from engine_hooks.config import ExporterConfig
from engine_hooks.exporter import Exporter
from engine_hooks.vllm.scheduler import XARGS_KEY, LedgerScheduler, iter_schedulers

# The exporter settings of the tests: no fsync, quick flushes and retries.
FAST = {
    "spool_fsync": False,
    "flush_interval_s": 0.01,
    "backoff_initial_s": 0.01,
    "backoff_max_s": 0.1,
    "max_attempts": 2,
    "timeout_s": 2.0,
    "connect_timeout_s": 0.5,
}
BUDGET = 128  # max_num_batched_tokens of the session engine
KV_TOKENS = 3072  # its KV cache, in tokens (24 blocks of 128 on the CPU backend)


def prompt(n: int, seed: int | str | None = None) -> list[int]:
    """``n`` random token ids; a fresh seed per call unless given (no accidental prefix-cache hits)."""
    rng = random.Random(seed if seed is not None else uuid.uuid4().hex)
    return [rng.randrange(10, 1300) for _ in range(n)]


def rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


class Stepping:
    """Driving an engine step by step: ``core.has_unfinished_requests()``, ``step()`` and ``finished``
    (the cpu :class:`Engine` and the synthetic one)."""

    core: Any
    finished: dict[str, Any]

    def step(self) -> list[Any]:
        raise NotImplementedError

    def run(self, *, max_steps: int = 20_000, on_step: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Step until nothing is left; ``on_step(i)`` before each step. Returns finished outputs."""
        i = 0
        while self.core.has_unfinished_requests():
            if on_step is not None:
                on_step(i)
            self.step()
            i += 1
            if i > max_steps:
                raise AssertionError(f"engine still busy after {max_steps} steps")
        return self.finished


class Engine(Stepping):
    """An in-process ``vllm.LLM`` with a LedgerScheduler, driven one engine step at a time."""

    def __init__(self, llm: Any):
        self.llm = llm
        self.core = llm.llm_engine
        self.scheduler: LedgerScheduler = next(iter(iter_schedulers(llm)))  # type: ignore[assignment]
        self.finished: dict[str, Any] = {}

    def add(self, request_id: str, tokens: list[int], max_tokens: int = 8, **params: Any) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0.0,
            extra_args={XARGS_KEY: request_id},
            **params,
        )
        self.core.add_request(request_id, TokensPrompt(prompt_token_ids=tokens), sp)

    def step(self) -> list[Any]:
        outs = self.core.step()
        for out in outs:
            if out.finished:
                self.finished[out.request_id] = out
        return outs

    def abort_all(self) -> None:
        ids = list(self.core.output_processor.request_states)
        if ids:
            self.core.abort_request(ids)
        while self.core.has_unfinished_requests():
            self.core.step()


def events_of(events: list[Any], kind: type, request_id: str | None = None) -> list[Any]:
    return [
        e
        for e in events
        if isinstance(e, kind) and (request_id is None or getattr(e, "request_id", None) == request_id)
    ]


def set_options(engine: Engine, **changes: Any) -> None:
    """Change the session scheduler's options (the ``attach`` fixture restores them)."""
    engine.scheduler.options = msgspec.structs.replace(engine.scheduler.options, **changes)


def attach_exporter(scheduler: Any, url: str, spool_dir: str, **settings: Any) -> Exporter:
    """Report ``scheduler``'s events to ``url`` under a fresh source id, with :data:`FAST` settings."""
    config = ExporterConfig.create(
        **{
            "url": url,
            "source_id": f"vllm-test-{uuid.uuid4().hex[:8]}",
            "spool_dir": spool_dir,
            **FAST,
            **settings,
        }
    )
    exporter = Exporter(config, on_command=scheduler.submit_command)
    scheduler.use_exporter(exporter)
    return exporter
