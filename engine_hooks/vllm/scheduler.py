"""vLLM v1 scheduler subclasses that report every engine step to the chunkledger ledger.

    vllm serve MODEL --scheduler-cls engine_hooks.vllm.LedgerScheduler        # CHUNKLEDGER_URL=...
    LLM(model, scheduler_cls="engine_hooks.vllm.LedgerScheduler", ...)
    # the async scheduler (vLLM's default on GPU): engine_hooks.vllm.AsyncLedgerScheduler

This module holds vLLM's entry points (``add_request``, ``schedule``, ``update_from_output``,
``finish_requests``, ``shutdown``) and the request ids; the work is done by mixins on the same object:

* :mod:`engine_hooks.vllm.reporter`: the events sent per step and per request (through one
  :class:`engine_hooks.exporter.Exporter`);
* :mod:`engine_hooks.vllm.commands`: the ledger's commands (``abort``, ``non_preemptible``,
  ``slow_pool``, ``promote``), applied at the start of the next ``schedule()``;
* :mod:`engine_hooks.vllm.policies`: the optional scheduling policies (all off by default,
  :mod:`engine_hooks.vllm.options`);
* :mod:`engine_hooks.vllm.compat`: what they read and patch inside vLLM; :mod:`engine_hooks.vllm.state`:
  the per-request state they share.

Request ids (the ``request_id`` of every event, :func:`external_request_id`): the gateway's,
``sampling_params.extra_args["chunkledger_request_id"]`` (OpenAI API: ``vllm_xargs``), when it set one.
Else the id the client knows, read back from the id vLLM's OpenAI server gave the engine request:
``cmpl-<id>-<prompt>`` (completions, one per prompt) or ``chatcmpl-<id>`` (chat), where ``<id>`` is the
client's ``X-Request-Id``, else its body ``request_id``, else 16 random hex digits; then ``<sample>_`` in
front for each of n>1 samples, and vLLM's random ``-<8 hex>`` at the end. From that:

* ``ID`` is the ``X-Request-Id`` (or body ``request_id``) the client sent; when it sent none, the
  response ``id`` vLLM returned to it: ``cmpl-<16 hex>`` / ``chatcmpl-<16 hex>``;
* the first engine request of a call (prompt 0, sample 0) is keyed ``ID``; the others ``ID:<prompt>``
  (completions with several prompts: the prompt's index, which is its choice ``index`` when n is 1) or
  ``ID:<prompt>.<sample>`` (n>1 samples after the first; ``<prompt>`` is 0 for chat): one row each;
* a chat ``<id>`` is kept whole: ``/v1/chat/completions/batch`` conversation ``i`` (vLLM's
  ``chatcmpl-<id>_<i>``) is keyed ``ID_<i>``, since a client id ending in ``_<digits>`` looks the same;
* beam search's per-token engine requests (``<id>-<16 hex>-beam-<i>``) keep that tail after ``ID``;
* any other id (offline ``LLM``, the other endpoints) is vLLM's id less its random suffix, as before.

A client ``X-Request-Id`` of exactly 16 lowercase hex digits cannot be told from vLLM's random id and
is keyed like one, by its response id ``cmpl-<it>`` / ``chatcmpl-<it>`` (which the client gets too).
With ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` set (read at import) no random suffix is stripped.

The hooks never raise into the engine: an error in them is counted (``hook_errors``), logged once per
place, and the engine goes on as plain vLLM.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from collections.abc import Iterable
from typing import Any

from vllm import envs
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from engine_hooks.config import ENV_PREFIX, ConfigError, ExporterSettings
from engine_hooks.events import XARGS_KEY
from engine_hooks.exporter import Exporter
from engine_hooks.vllm import compat, state
from engine_hooks.vllm.commands import Commands
from engine_hooks.vllm.options import LedgerOptions
from engine_hooks.vllm.policies import EscapeGrant, Policies
from engine_hooks.vllm.reporter import Reporter, StepRecord

log = state.log
compat.check_version()
_ReqState = state.ReqState  # the names the tests and older callers reach here
_vllm_stamp = compat.vllm_stamp

# vLLM's request ids (see external_request_id): the random suffix InputProcessor.assign_request_id adds
# (f"-{random_uuid():.8}", unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION, read at import like vLLM's
# engine process does), the OpenAI server's completion and chat ids with the n>1 child prefix
# (ParentRequest.get_child_info: f"{index}_{request_id}") and beam search's per-token ids, and
# random_uuid()'s 16 hex digits (the id vLLM makes up when the client sent none).
_SUFFIX = re.compile(r"-[0-9a-f]{8}\Z")
_RANDOMIZED = not envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION
_OPENAI_ID = re.compile(r"(?:(\d+)_)?(cmpl|chatcmpl)-")  # then the base request id
_BEAM = re.compile(r"(.*)(-[0-9a-f]{16}-beam-\d+)", re.DOTALL)
_PROMPT = re.compile(r"(.*)-(\d+)", re.DOTALL)
_VLLM_UUID = re.compile(r"[0-9a-f]{16}")
_VLLM_CHAT_UUID = re.compile(r"[0-9a-f]{16}(?:_\d+)?")  # chat's batch sub-ids: f"{request_id}_{i}"
_ID_MAX = 256  # events.RequestId's max_length


def external_request_id(request: Request) -> str:
    """The id the ledger knows the request by: the client's (the module docstring's "Request ids").

    1. ``sampling_params.extra_args[XARGS_KEY]`` (the gateway's id), when a str of 1 to 256 chars.
    2. vLLM's ``request_id`` less its ``-<8 hex>`` random suffix (``InputProcessor.assign_request_id``).
    3. When that is ``[<sample>_](cmpl|chatcmpl)-<base>`` (``OpenAIServingCompletion``,
       ``OpenAIServingChat``; ``<sample>_`` from ``ParentRequest.get_child_info`` for n>1): a trailing
       ``-<16 hex>-beam-<i>`` (beam search) is set aside as the tail; else, for ``cmpl``, the trailing
       ``-<prompt>`` (the prompt's index, always there) is split off. ``ID`` is ``<base>`` (the
       client's ``X-Request-Id`` or body ``request_id``), or the response id ``<kind>-<base>`` when
       ``<base>`` is empty or vLLM's own ``random_uuid()`` (16 lowercase hex digits; for chat also with
       a batch's ``_<i>``). The key: ``ID + tail``, then ``:<prompt or 0>.<sample>`` when
       ``<sample>`` is not 0, else ``:<prompt>`` when ``<prompt>`` is not 0.
    4. Any other id: as in 2.

    E.g. ``cmpl-abc-0-1f2e3d4c`` -> ``abc``; ``cmpl-abc-2-...`` -> ``abc:2``; ``1_cmpl-abc-0-...`` ->
    ``abc:0.1``; ``chatcmpl-abc-...`` -> ``abc``; ``cmpl-<16 hex>-0-...`` -> ``cmpl-<16 hex>``.
    A key longer than the contract's 256 characters keeps its first 239 and ``~<16 hex>`` of a hash of
    the whole. A few regex matches on a short string: cheap enough for every new request on the
    engine thread.
    """
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    if extra:
        rid = extra.get(XARGS_KEY)
        if isinstance(rid, str) and 0 < len(rid) <= 256:
            return rid
    key = _client_key(request.request_id)
    if len(key) > _ID_MAX:  # the contract's limit: a longer id would make the ledger refuse the batch
        digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
        key = f"{key[: _ID_MAX - 17]}~{digest}"
    return key


def _client_key(rid: str) -> str:
    if _RANDOMIZED:
        rid = _SUFFIX.sub("", rid) or rid
    match = _OPENAI_ID.match(rid)
    if match is None:
        return rid
    sample, kind = match.groups()
    base = rid[match.end() :]
    tail = prompt = None
    if "-beam-" in base and (beam := _BEAM.fullmatch(base)) is not None:
        base, tail = beam.groups()
    if kind == "cmpl":
        if tail is None and (split := _PROMPT.fullmatch(base)) is not None:
            base, prompt = split.groups()
        ours = _VLLM_UUID.fullmatch(base)
    else:
        ours = _VLLM_CHAT_UUID.fullmatch(base)
    key = f"{kind}-{base}" if ours is not None or not base else base
    if tail is not None:
        key += tail
    if sample is not None and sample != "0":
        return f"{key}:{prompt or 0}.{sample}"
    if prompt is not None and prompt != "0":
        return f"{key}:{prompt}"
    return key


def source_id(vllm_config: Any, configured: str | None) -> str:
    """The source this engine core reports as: ``configured`` (``CHUNKLEDGER_SOURCE_ID``), else
    ``vllm-<hostname>``; with data parallelism each rank's core adds ``-dp<rank>``, so the ranks of one
    server (each with its own scheduler, step counter and KV cache) are distinct sources, whatever
    was configured. The rank is ``parallel_config.data_parallel_index`` (vLLM 0.32 to 0.34: the true
    rank, also for dense models, whose ``data_parallel_rank`` vLLM sets to 0)."""
    base = configured or f"vllm-{socket.gethostname()}"[:100]
    parallel = vllm_config.parallel_config
    rank = getattr(parallel, "data_parallel_index", getattr(parallel, "data_parallel_rank", 0))
    if int(getattr(parallel, "data_parallel_size", 1)) > 1 or rank:
        suffix = f"-dp{rank}"
        return base[: 128 - len(suffix)] + suffix  # the contract's 128 characters
    return base


class _LedgerHooks(Reporter, Commands, Policies):
    """The hooks, shared by the sync and async scheduler classes (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook_errors = 0  # exceptions caught in the hooks (each place is logged once)
        self.hook_seconds = 0.0  # engine-thread time spent in the hooks (schedule and update)
        # and the engine thread's CPU time in them (hook_seconds also holds its waits for the GIL)
        self.hook_cpu_seconds = 0.0
        self._cl_logged = set()
        config = self.vllm_config
        extra = config.additional_config if isinstance(config.additional_config, dict) else {}
        self.options = LedgerOptions.from_sources(extra=extra.get("chunkledger") or {})
        self._cl_init_reporter()
        self._cl_init_commands()
        self._cl_init_policies()
        self.use_exporter(self._make_exporter())

    def _make_exporter(self) -> Exporter | None:
        env = os.environ
        if not env.get(ENV_PREFIX + "URL"):
            log.warning(
                "chunkledger: CHUNKLEDGER_URL is not set; %s runs without reporting to a ledger",
                type(self).__name__,
            )
            return None
        configured = env.get(ENV_PREFIX + "SOURCE_ID")
        overrides: ExporterSettings = {"source_id": source_id(self.vllm_config, configured)}
        if not env.get(ENV_PREFIX + "MODEL"):
            name = self.vllm_config.model_config.served_model_name
            if isinstance(name, list):
                name = name[0] if name else None
            overrides["model"] = name or None
        try:
            return Exporter.from_env(on_command=self.submit_command, **overrides)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"chunkledger exporter settings: {exc}") from None

    # -- vLLM entry points ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        with self._cl_lock:
            self._cl_add_request(request)

    def _cl_add_request(self, request: Request) -> None:
        super().add_request(request)
        if not self._cl_active:
            return
        try:
            if request.request_id in self._cl_states:
                self._cl_fold()  # it may have finished in outputs not folded yet
            st = self._cl_states.get(request.request_id)
            if st is not None:  # a streaming-input continuation of a known request
                st.streamed = True
                st.fast = False
                return
            now, ts = self.clock(), time.time()
            ext = external_request_id(request)
            self._cl_report_queued(request, ext, now, ts)
            if self._cl_unmatched:
                self._cl_release_parked(ext)
        except Exception:
            self._cl_fail("add_request")

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        with self._cl_lock:
            return self._cl_schedule(*args, **kwargs)

    def _cl_schedule(self, *args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        now = self.clock()
        ts = time.time()
        restore: int | None = None
        scheduled_at = now  # when vLLM schedules (its SCHEDULED stamp): waits end here
        if self._cl_active:
            try:
                if self._cl_inbox or self._cl_unmatched or self._cl_policies_read_outputs():
                    self._cl_fold()  # the requests' state as of the last step (.folding)
                if self._cl_inbox or self._cl_unmatched:
                    self._cl_take_commands(now, ts)
                throttle = bool(args[0] if args else kwargs.get("throttle_prefills", False))
                restore = self._cl_apply_policies(now, throttle)
            except Exception:
                self._cl_fail("before_schedule")
            scheduled_at = self.clock()
            self.hook_seconds += time.perf_counter() - t0
            self.hook_cpu_seconds += time.thread_time() - c0
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self._cl_current = None
            if restore is not None or self._cl_budget_restore is not None or self._cl_held is not None:
                self._cl_undo_policies(restore)
        if self._cl_active:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                opts = self.options
                if output.preempted_req_ids:
                    self._cl_fold()  # their tokens go out before their preemption
                if opts.preempt_escape_after and opts.preempt_escape_for == "predicted":
                    self._cl_grant_escapes(output.preempted_req_ids, opts.preempt_escape_after)
                self._cl_report_schedule(output, scheduled_at, ts, now)
            except Exception:
                self._cl_fail("after_schedule")
            self.hook_seconds += time.perf_counter() - t0
            self.hook_cpu_seconds += time.thread_time() - c0
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._cl_active:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                ts = time.time()
                now = self.clock()
                lists = [eco.outputs[:] for eco in outputs.values()]  # before aborts join them
                folder = self._cl_folder
                if (
                    folder is None
                    or len(folder)  # the engine did not wait long enough to fold the last step's
                    or self.options.step_tokens  # its columns ride on the step event
                    or not (self.running or self.waiting)  # the engine goes idle
                ):
                    with self._cl_lock:
                        self._cl_fold()
                        self._cl_report_outputs(lists, ts, now)
                else:
                    folder.put(lists, ts, now)  # folded while the engine waits (.folding)
                # The rest touches no request state (the folder may be folding beside it).
                if self._cl_abort_outputs:
                    self._cl_deliver_aborts(outputs)
                self._cl_report_step(scheduler_output, now)
            except Exception:
                self._cl_fail("update_from_output")
            self.hook_seconds += time.perf_counter() - t0
            self.hook_cpu_seconds += time.thread_time() - c0
        return outputs

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        # compat.PREEMPT_METHOD: called by vLLM before it resets the request (the reporter's fast path)
        if self._cl_active:
            try:
                self._cl_preempting(request)
            except Exception:
                self._cl_fail("preempt_request")
        super()._preempt_request(request, *args, **kwargs)  # type: ignore[misc]

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        with self._cl_lock:
            finished = super().finish_requests(request_ids, finished_status)
            if self._cl_active and finished:
                try:
                    self._cl_fold()
                    self._cl_report_finished(finished, finished_status)
                except Exception:
                    self._cl_fail("finish_requests")
            return finished

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._cl_folder is not None:
                try:
                    self._cl_folder.close()
                except Exception:
                    self._cl_fail("shutdown")
            exporter = self._cl_exporter
            if exporter is not None:
                try:
                    exporter.shutdown(exporter.config.shutdown_timeout_s)
                except Exception:
                    self._cl_fail("shutdown")


class LedgerScheduler(_LedgerHooks, Scheduler):
    """vLLM v1's scheduler reporting to chunkledger: the one class to name, in either scheduling mode.

    ``--scheduler-cls engine_hooks.vllm.LedgerScheduler``

    With async scheduling on (vLLM's default on GPU) it is built as :class:`AsyncLedgerScheduler`,
    vLLM's ``AsyncScheduler`` with the hooks, since a plain ``Scheduler`` under the engine core's batch
    queue loses the overlap of step N+1's scheduling with step N (vLLM keeps async on and only warns).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> LedgerScheduler:
        built = cls
        config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is LedgerScheduler and compat.async_scheduling(config):
            log.info("chunkledger: async scheduling is on: LedgerScheduler runs as AsyncLedgerScheduler")
            built = AsyncLedgerScheduler
        return super().__new__(built)


class AsyncLedgerScheduler(LedgerScheduler, AsyncScheduler):
    """vLLM v1's ``AsyncScheduler`` reporting to chunkledger (what :class:`LedgerScheduler` becomes when
    async scheduling is on; naming it directly works too)."""


def iter_schedulers(llm: Any) -> Iterable[_LedgerHooks]:
    """The ledger schedulers of an in-process ``vllm.LLM`` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = getattr(getattr(llm, "llm_engine", llm), "engine_core", None)
    core = getattr(core, "engine_core", core)
    scheduler = getattr(core, "scheduler", None)
    if isinstance(scheduler, _LedgerHooks):
        yield scheduler


__all__ = [
    "XARGS_KEY",
    "AsyncLedgerScheduler",
    "EscapeGrant",
    "LedgerScheduler",
    "StepRecord",
    "external_request_id",
    "iter_schedulers",
    "source_id",
]
