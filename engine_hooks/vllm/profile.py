"""The vLLM driver of ``chunkledger profile``: runs a profile plan on vLLM in this process.

Drives vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with chunkledger's scheduler plugin
(``engine_hooks.vllm.LedgerScheduler``) through a controlled plan:

* for every decode batch B and chunk size T: B short requests that keep decoding, plus one long
  prompt of ``max_depth + T`` tokens whose prefill is chunked by T (the plugin's scheduler gets
  ``long_prefill_token_threshold = T`` between runs), so the long prompt runs chunks of T tokens at
  depths 0, T, 2T, ... max_depth next to B decodes; after it the B requests decode alone for
  ``tail_steps`` steps (decode-only steps at batch B);
* the plugin reports every step (the same ``step`` events production sends) to a :class:`StepRecorder`,
  which keeps them and, with a ledger URL, also hands them to the plugin's own exporter, so that
  ``chunkledger advise --source <id>`` can use them later.

Prompts are random token ids (no tokenizer cost, exact lengths); prefix caching is off so depth is
computed, not cached. The plan and what is made of the steps (the tables, the fit, the advice) are the
ledger's (:mod:`ledger.advice.profile`); the command line joins the two (``chunkledger profile``). This
module imports no part of the ledger, and vLLM only when it runs.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from engine_hooks import events as ev
from engine_hooks.profile_run import Delivery, Phase, ProfileRun
from engine_hooks.vllm.cpu import LLMKwargs, engine_settings


class EngineKwargs(LLMKwargs, total=False):
    """The keyword arguments the driver gives ``vllm.LLM(...)``: :class:`LLMKwargs` (what
    ``EngineSettings.llm_kwargs()`` gives) and the profile's own."""

    model: str  # a model directory or name
    served_model_name: str
    scheduler_cls: str
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    enforce_eager: bool
    kv_cache_memory_bytes: int
    seed: int


class DriverError(RuntimeError):
    """vLLM cannot run the plan (not installed, the engine did not start, the plugin is not in this
    process or runs scheduling policies); the message says what to do."""


class Plan(Protocol):
    """What the driver reads of a profile plan (:class:`ledger.advice.profile.ProfilePlan`)."""

    @property
    def chunk_sizes(self) -> tuple[int, ...]: ...
    @property
    def decode_batches(self) -> tuple[int, ...]: ...
    @property
    def decode_prompt_tokens(self) -> int: ...
    @property
    def max_depth(self) -> int: ...
    @property
    def repeats(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    def decode_tokens_for(self, chunk: int) -> int: ...
    def check(self) -> None: ...


class StepRecorder:
    """An in-process sink with the exporter's ``emitter`` interface: keeps the ``step`` events and
    hands every event on to ``forward`` (the plugin's own exporter, sending to a ledger) if given."""

    def __init__(self, forward: Any = None) -> None:
        self.forward = forward
        self.steps: list[ev.Step] = []
        self.paused = False  # while True nothing is kept or sent (the warm-up run)
        self._seq = 0
        self.config = getattr(forward, "config", None)

    def emitter(self, kind: type[Any], *fields: str) -> Any:
        send = self.forward.emitter(kind, *fields) if self.forward is not None else None
        keep = kind is ev.Step
        steps = self.steps

        def emit(*values: Any) -> None:
            if self.paused:
                return
            if keep:
                self._seq += 1
                steps.append(ev.Step(seq=self._seq, **dict(zip(fields, values, strict=True))))
            if send is not None:
                send(*values)

        def many(rows: Any) -> None:
            for row in rows:
                emit(*row)

        emit.many = many  # type: ignore[attr-defined]
        return emit

    def shutdown(self, timeout: float | None = None) -> bool:
        return self.forward.shutdown(timeout) if self.forward is not None else True


def run_profile(
    model: str,
    plan: Plan,
    *,
    served_model_name: str | None = None,
    ledger_url: str | None = None,
    source_id: str | None = None,
    ingest_token: str | None = None,
    kv_cache_bytes: int = 512 << 20,
    engine_kwargs: EngineKwargs | None = None,
    progress: Callable[[Phase], None] | None = None,
) -> ProfileRun:
    """Run ``plan`` on vLLM in this process and return the recorded steps (see the module docstring).

    ``model`` is a model directory or name vLLM can load offline, served as ``served_model_name`` (by
    default the directory's name). With ``ledger_url`` the plugin's exporter also sends every event
    there as source ``source_id``. ``progress(phase)`` is called after each :class:`Phase`.
    ``engine_kwargs`` win over the driver's own arguments to ``vllm.LLM`` (its ``dtype`` also over
    :func:`engine_hooks.vllm.cpu.engine_settings`' choice).
    """
    plan.check()
    name = served_model_name or os.path.basename(os.path.normpath(model)) or model
    # in-process engine: the plugin's scheduler is reachable; no ledger unless asked for
    env: dict[str, str | None] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "CHUNKLEDGER_URL": None}
    if ledger_url:
        env.update(
            CHUNKLEDGER_URL=ledger_url,
            CHUNKLEDGER_SOURCE_ID=source_id or f"profile-{name}"[:128],
            CHUNKLEDGER_MODEL=name,
            CHUNKLEDGER_INGEST_TOKEN=ingest_token,
            CHUNKLEDGER_SPOOL_MAX_BYTES="0",  # a profile that cannot reach its ledger fails loudly
        )
    # The plugin's optional policies (admission reserve, victim choice) would change what runs:
    # the profile measures plain vLLM scheduling, so their variables are cleared while it runs.
    env.update({k: None for k in os.environ if k.startswith("CHUNKLEDGER_VLLM_")})
    saved = {k: os.environ.get(k) for k in env}
    _set_env(env)
    try:
        return _run(model, name, plan, progress, kv_cache_bytes, engine_kwargs)
    finally:
        _set_env(saved)


def _set_env(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # ids above the special tokens, below the vocabulary; random so no two prompts share a prefix
    return [rng.randrange(8, vocab) for _ in range(n)]


def _run(
    model: str,
    name: str,
    plan: Plan,
    progress: Callable[[Phase], None] | None,
    kv_cache_bytes: int,
    engine_kwargs: EngineKwargs | None,
) -> ProfileRun:
    llm = _start_engine(model, name, plan, kv_cache_bytes, engine_kwargs)
    try:
        scheduler, recorder = _take_scheduler(llm)
        forward = recorder.forward
        phases = _measure(llm, scheduler, recorder, plan, progress)
        sent = _delivered(forward) if forward is not None else None
        scheduler.use_exporter(None)
        return ProfileRun(
            model=name,
            steps=list(recorder.steps),
            phases=phases,
            source_id=forward.source.id if forward is not None else None,
            sent=sent,
        )
    finally:
        del llm


def _delivered(forward: Any) -> Delivery:
    """The plugin's exporter stopped (its events delivered or given up on), and what it delivered."""
    forward.shutdown(30.0)
    stats = forward.stats()
    url = forward.config.url  # the ledger URL the profile was given (CHUNKLEDGER_URL)
    return Delivery(url=url, source_id=forward.source.id, sent=stats.sent, dropped=stats.dropped)


def _start_engine(
    model: str, name: str, plan: Plan, kv_cache_bytes: int, engine_kwargs: EngineKwargs | None
) -> Any:
    """vLLM's ``LLM`` with the plugin, in this process, sized for ``plan``, eager, no prefix cache."""
    try:
        from vllm import LLM
    except ImportError as exc:
        raise DriverError(
            f"vLLM with chunkledger's plugin is needed ({exc}); install chunkledger[vllm]"
        ) from None
    settings = engine_settings(dtype=(engine_kwargs or {}).get("dtype"))
    settings.apply_threads()
    kwargs: EngineKwargs = {
        **settings.llm_kwargs(),
        "model": model,
        "served_model_name": name,
        "scheduler_cls": "engine_hooks.vllm.LedgerScheduler",
        "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
        "max_num_seqs": max(max(plan.decode_batches) + 1, 8),
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "seed": plan.seed,
        **(engine_kwargs or {}),
    }
    try:
        return LLM(**kwargs)
    except Exception as exc:  # vLLM raises many types for an engine it cannot build
        raise DriverError(f"vLLM could not start {model!r}: {type(exc).__name__}: {exc}") from exc


def _take_scheduler(llm: Any) -> tuple[Any, StepRecorder]:
    """The engine's ``LedgerScheduler``, its threshold on a private config, its steps recorded (and
    forwarded to its exporter, if it has one)."""
    from engine_hooks.vllm.scheduler import iter_schedulers

    schedulers = list(iter_schedulers(llm))
    if not schedulers:
        raise DriverError(
            "the engine does not run chunkledger's LedgerScheduler in this process; "
            "is VLLM_ENABLE_V1_MULTIPROCESSING=0 honoured by this vLLM?"
        )
    scheduler: Any = schedulers[0]
    if scheduler.options.reorders:
        raise DriverError(
            "the engine runs chunkledger scheduling policies (additional_config); "
            "profile without them so plain chunking is measured"
        )
    # The threshold changes between runs: on a private copy of the config, not the engine's.
    scheduler.scheduler_config = copy.copy(scheduler.scheduler_config)
    scheduler.adaptive_long_prefill_threshold = False
    recorder = StepRecorder(scheduler.exporter)
    scheduler.use_exporter(recorder)
    return scheduler, recorder


def _measure(
    llm: Any, scheduler: Any, recorder: StepRecorder, plan: Plan, progress: Callable[[Phase], None] | None
) -> list[Phase]:
    """A warm-up, then each (decode batch, chunk size) of the plan ``plan.repeats`` times: the decodes
    running while one long prompt prefills in chunks of that size at ``plan.max_depth``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(plan.seed)
    phases: list[Phase] = []
    # A warm-up run: first steps pay lazy initialisation; none of its events is kept or sent.
    recorder.paused = True
    llm.generate(
        [TokensPrompt(prompt_token_ids=_prompt(rng, 64, vocab))],
        SamplingParams(max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    recorder.paused = False
    for _ in range(plan.repeats):
        for batch in plan.decode_batches:
            for chunk in plan.chunk_sizes:
                scheduler.scheduler_config.long_prefill_token_threshold = chunk
                decode = SamplingParams(max_tokens=plan.decode_tokens_for(chunk), ignore_eos=True)
                prompts = [
                    TokensPrompt(prompt_token_ids=_prompt(rng, plan.decode_prompt_tokens, vocab))
                    for _ in range(batch)
                ]
                prompts.append(TokensPrompt(prompt_token_ids=_prompt(rng, plan.max_depth + chunk, vocab)))
                params = [decode] * batch + [SamplingParams(max_tokens=1, ignore_eos=True)]
                first = len(recorder.steps)
                t0 = time.monotonic()
                llm.generate(prompts, params, use_tqdm=False)
                phases.append(Phase(chunk, batch, first, len(recorder.steps), time.monotonic() - t0))
                if progress is not None:
                    progress(phases[-1])
    return phases


__all__ = ["DriverError", "Plan", "StepRecorder", "run_profile"]
