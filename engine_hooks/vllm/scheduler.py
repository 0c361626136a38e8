"""vLLM v1 scheduler subclasses that report every engine step to the chunkledger ledger.

    vllm serve MODEL --scheduler-cls engine_hooks.vllm.LedgerScheduler        # CHUNKLEDGER_URL=...
    LLM(model, scheduler_cls="engine_hooks.vllm.LedgerScheduler", ...)
    # the async scheduler (vLLM's default on GPU): engine_hooks.vllm.AsyncLedgerScheduler

What is reported, per engine step (all through one :class:`engine_hooks.exporter.Exporter`):

* ``queued`` when the scheduler receives a request (``arrival_ts`` is the front end's arrival time);
* ``chunk`` for every prefill slice scheduled (first pass, and recompute passes after a preemption,
  whose ``recomputed_tokens`` are the positions the request had computed before), with its depth
  (``computed_before``), prefix-cache hits on the first chunk and the request's KV blocks;
* ``preempted`` / ``resumed`` (with the output tokens it had, so the ledger can tell a prefill wait
  from a decode wait);
* ``tokens``: output tokens coalesced per request (every ``tokens_flush`` tokens or ``tokens_flush_s``
  seconds, and at finish or preemption), with their ids unless ``token_ids`` is off;
* ``finished`` with vLLM's finish reason (``cutoff`` for the ledger's aborts);
* ``step``: monotonic duration from ``schedule()`` to the end of ``update_from_output()``, prefill and
  decode counts, queue sizes, KV usage, the requests that ran, prefill depth work, and the requests
  that held KV blocks but sat the step out (``stalled_*``).

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

Commands from the ledger (``abort``, ``non_preemptible``, ``slow_pool``, ``promote``) arrive on the
exporter's worker thread, are queued, and are applied on the engine thread at the start of the next
``schedule()``; each applied command is confirmed with a ``cutoff_applied`` event, once per command id.
An abort frees the request's KV (``finish_requests``) and sends the client an output with
``finish_reason=abort`` and ``stop_reason="chunkledger:<rule>"``.

The hooks never raise into the engine: an error in them is counted (``hook_errors``), logged once per
place, and the engine goes on as plain vLLM. Optional scheduling policies (all off by default) are in
:mod:`engine_hooks.vllm.options`.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import re
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, SupportsIndex, cast

from vllm import envs
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from engine_hooks.config import ENV_PREFIX, ConfigError
from engine_hooks.events import (
    Chunk,
    Command,
    CutoffApplied,
    Finished,
    Preempted,
    Queued,
    Resumed,
    Step,
    Tokens,
)
from engine_hooks.exporter import Emitter, Exporter
from engine_hooks.vllm.options import LedgerOptions
from engine_hooks.vllm.predict import OutputLengths, StepTimes, attention_work

log = logging.getLogger(__name__)

XARGS_KEY = "chunkledger_request_id"  # sampling_params.extra_args key carrying the gateway's id
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
_APPLIED_MEMORY = 4096  # command ids remembered for idempotency
_UNMATCHED_TTL_S = 60.0  # how long a command for a request not (yet) in this engine is kept
_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}
_STATUS_FINISH = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}

_WAITING, _RUNNING, _PREEMPTED = 0, 1, 2
_QUEUED, _SCHEDULED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED


def _vllm_stamp(request: Request, kind: EngineCoreEventType, now: float) -> float:
    """vLLM's own monotonic stamp of what just happened to ``request`` (the last of its ``events``,
    recorded when vLLM logs stats: QUEUED in ``add_request``, SCHEDULED in ``schedule``), so that the
    waits measured here are the spans vLLM's ``request_queue_time_seconds`` reports; else ``now``."""
    events = request.events
    if events:
        last = events[-1]
        if last.type == kind and abs(now - last.timestamp) < 1.0:
            return last.timestamp
    return now


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


class _ReqState:
    """What the hooks remember about one request between steps."""

    __slots__ = (
        "blocks",
        "chunks",
        "client",
        "computed",
        "cutoff",
        "escape_next",
        "escape_until",
        "ext",
        "hw",
        "last_active",
        "non_preemptible",
        "out_at_preempt",
        "output",
        "pending",
        "pending_first_ts",
        "promoted",
        "queued_t",
        "sat_out",
        "slow",
        "state",
        "waiting_since",
    )

    def __init__(self, ext: str, client: int, now: float):
        self.ext = ext
        self.client = client
        self.queued_t = self.waiting_since = self.last_active = now
        self.state = _WAITING
        self.chunks = 0  # prefill chunks reported so far
        self.hw = 0  # high-water mark of computed tokens (positions recomputed after a preemption)
        self.computed = 0  # computed tokens after its last scheduled step
        self.blocks = 0  # KV blocks held after its last scheduled step
        self.output = 0  # output tokens so far
        self.out_at_preempt = 0
        self.pending: list[int] = []  # output token ids not yet sent
        self.pending_first_ts = 0.0
        self.sat_out = 0  # consecutive steps it held KV (or waited, for slow_pool) without running
        self.cutoff: str | None = None  # stop reason of an abort command being applied
        self.escape_next = 0  # preemptions at which the escape valve ("predicted") next protects it
        self.escape_until: int | None = None  # protected by it until this many output tokens
        self.non_preemptible = self.slow = self.promoted = False


class _NullEmitter:
    """Stands in for an exporter emitter when no ledger is configured."""

    def __call__(self, *values: Any) -> None:
        pass

    def many(self, rows: Any) -> None:
        pass


class _RunningList(list):  # type: ignore[type-arg]
    """vLLM's running list, whose argument-less ``pop()`` (FCFS victim choice) asks ``chooser``."""

    chooser: Callable[[list[Any]], Any] | None = None

    def pop(self, index: SupportsIndex = -1) -> Any:
        if index == -1 and self.chooser is not None and len(self) > 1:
            victim = self.chooser(self)
            if victim is not None:
                for i in range(len(self) - 1, -1, -1):
                    if self[i] is victim:
                        return super().pop(i)
        return super().pop(index)


class EscapeGrant(NamedTuple):
    """One protection by the escape valve in ``"predicted"`` mode (``scheduler.escape_grants``)."""

    request_id: str  # external id
    preemptions: int  # its preemptions when protected
    output_tokens: int  # output tokens it had then
    until: int  # protected until it has this many output tokens


if TYPE_CHECKING:
    _Base = Scheduler
else:
    _Base = object


class _LedgerHooks(_Base):
    """The hooks, shared by the sync and async scheduler classes (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook_errors = 0  # exceptions caught in the hooks (each place is logged once)
        self.hook_seconds = 0.0  # engine-thread time spent in the hooks (schedule and update)
        self._cl_logged: set[str] = set()
        self._cl_active = False
        self._cl_exporter: Exporter | None = None
        config = self.vllm_config
        extra = config.additional_config if isinstance(config.additional_config, dict) else {}
        self.options = LedgerOptions.from_sources(extra=extra.get("chunkledger") or {})
        self._cl_states: dict[str, _ReqState] = {}
        self._cl_by_ext: dict[str, set[str]] = {}
        self._cl_inbox: deque[Command] = deque()
        self._cl_unmatched: dict[str, list[tuple[float, Command]]] = {}
        self._cl_applied: OrderedDict[str, None] = OrderedDict()
        self._cl_abort_outputs: list[tuple[int, EngineCoreOutput]] = []
        self._cl_pending: dict[str, _ReqState] = {}
        self._cl_steps: dict[int, tuple[Any, ...]] = {}
        self._cl_step = 0
        self._cl_marked = 0  # requests marked slow_pool or promote (reordering needed)
        self._cl_protected = 0  # requests marked non_preemptible
        self._cl_slow_running = False  # a slow_pool request is in the running queue
        self._cl_current: Any = None  # the request being allocated (victim choice)
        self.output_lengths = OutputLengths()  # finished output lengths: the escape valve's predictor
        self.escape_grants: deque[EscapeGrant] = deque(maxlen=1024)  # "predicted" protections, newest last
        self.escape_lapses = 0  # "predicted" protections that ran out before the request finished
        self.step_times = StepTimes()  # measured step durations: admission_step_target_s's predictor
        self.step_caps: deque[tuple[int, int, int]] = deque(maxlen=4096)  # (step, depth, cap) of the
        # steps whose chunk cap came from admission_step_target_s, newest last
        self._cl_blocks = self._block_counter()
        self._cl_alone = False  # this step's cap is for a prefill running alone (set by the cap)
        self._cl_budget_restore: int | None = None  # the token budget to restore after schedule()
        self._cl_held: tuple[int, Any] | None = None  # (index, request) left out of running this step
        self._cl_held_last = False  # the previous step left the long prefill out (arrivals first)
        self.arrival_steps = 0  # steps that left a long prefill out for arrivals (arrivals first)
        # The reserve and the commands set long_prefill_token_threshold per step: on a private copy.
        self.scheduler_config = copy.copy(self.scheduler_config)
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def allocate_slots(request: Any, *a: Any, **kw: Any) -> Any:
            self._cl_current = request
            return allocate(request, *a, **kw)

        manager.allocate_slots = allocate_slots  # type: ignore[method-assign]
        self.use_exporter(self._make_exporter())

    # -- setup ------------------------------------------------------------------------------------

    def _make_exporter(self) -> Exporter | None:
        env = os.environ
        if not env.get(ENV_PREFIX + "URL"):
            log.warning(
                "chunkledger: CHUNKLEDGER_URL is not set; %s runs without reporting to a ledger",
                type(self).__name__,
            )
            return None
        overrides: dict[str, Any] = {}
        if not env.get(ENV_PREFIX + "SOURCE_ID"):
            dp = self.vllm_config.parallel_config.data_parallel_index
            overrides["source_id"] = f"vllm-{socket.gethostname()}"[:100] + (f"-dp{dp}" if dp else "")
        if not env.get(ENV_PREFIX + "MODEL"):
            name = self.vllm_config.model_config.served_model_name
            overrides["model"] = (name[0] if isinstance(name, list) and name else name) or None
        try:
            return Exporter.from_env(on_command=self.submit_command, **overrides)
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(f"chunkledger exporter settings: {exc}") from None

    def use_exporter(self, exporter: Exporter | None) -> None:
        """Send events through ``exporter`` from now on (None: stop reporting; commands still apply).

        The exporter's ``on_command`` should be :meth:`submit_command`. The previous exporter is not
        shut down here.
        """
        self._cl_exporter = exporter
        if exporter is None:
            null = cast(Emitter, _NullEmitter())
            self._e_queued = self._e_chunk = self._e_tokens = self._e_preempted = null
            self._e_resumed = self._e_finished = self._e_cutoff = self._e_step = null
        else:
            e = exporter.emitter
            self._e_queued = e(
                Queued, "ts", "request_id", "prompt_tokens", "max_tokens", "arrival_ts", "priority"
            )
            self._e_chunk = e(
                Chunk,
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
            self._e_tokens = e(
                Tokens, "ts", "request_id", "count", "total", "first_ts", "kv_blocks", "token_ids"
            )
            self._e_preempted = e(Preempted, "ts", "request_id", "kv_blocks_freed", "computed_tokens")
            self._e_resumed = e(Resumed, "ts", "request_id", "wait_s", "cached_tokens", "output_tokens")
            self._e_finished = e(
                Finished, "ts", "request_id", "reason", "output_tokens", "stop_reason", "wait_s"
            )
            self._e_cutoff = e(CutoffApplied, "ts", "request_id", "command_id", "action", "rule")
            self._e_step = e(
                Step,
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
            )
        self._cl_active = True

    @property
    def exporter(self) -> Exporter | None:
        return self._cl_exporter

    def submit_command(self, command: Command) -> None:
        """Queue a ledger command; applied at the next ``schedule()``. Safe from any thread."""
        self._cl_inbox.append(command)

    def _block_counter(self) -> Callable[[str, int], int]:
        """req id -> KV blocks it holds: the first KV group's block list, else computed tokens / block."""
        try:
            table = self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        except (AttributeError, IndexError):
            size = max(int(self.block_size), 1)
            return lambda rid, computed: -(-computed // size)

        def count(rid: str, computed: int) -> int:
            blocks = table.get(rid)
            return len(blocks) if blocks else 0

        return count

    def _cl_fail(self, where: str) -> None:
        self.hook_errors += 1
        if where not in self._cl_logged:
            self._cl_logged.add(where)
            log.error("chunkledger: hook %s failed; the engine goes on (logged once)", where, exc_info=True)

    # -- vLLM entry points ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        if not self._cl_active:
            return
        try:
            rid = request.request_id
            if rid in self._cl_states:  # a streaming-input continuation of a known request
                return
            now, ts = time.monotonic(), time.time()
            ext = external_request_id(request)
            self._cl_states[rid] = _ReqState(ext, request.client_index, _vllm_stamp(request, _QUEUED, now))
            ids = self._cl_by_ext.get(ext)
            if ids is None:
                self._cl_by_ext[ext] = {rid}
            else:
                ids.add(rid)
            arrival = request.arrival_time
            self._e_queued(
                ts,
                ext,
                request.num_prompt_tokens,
                request.max_tokens,
                arrival if arrival and arrival > 0 else None,
                request.priority,
            )
            if self._cl_unmatched:
                parked = self._cl_unmatched.pop(ext, None)
                if parked:
                    self._cl_inbox.extendleft(cmd for _, cmd in reversed(parked))
        except Exception:
            self._cl_fail("add_request")

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        ts = time.time()
        restore: int | None = None
        scheduled_at = now  # when vLLM schedules (its SCHEDULED stamp): waits end here
        if self._cl_active:
            try:
                restore = self._cl_before_schedule(now, ts)
            except Exception:
                self._cl_fail("before_schedule")
            scheduled_at = time.monotonic()
            self.hook_seconds += scheduled_at - now
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self._cl_current = None
            if restore is not None:
                self.scheduler_config.long_prefill_token_threshold = restore
            if self._cl_budget_restore is not None:
                self.max_num_scheduled_tokens = self._cl_budget_restore
                self._cl_budget_restore = None
            if self._cl_held is not None:
                index, held = self._cl_held
                self._cl_held = None
                self.running.insert(min(index, len(self.running)), held)
        if self._cl_active:
            t0 = time.monotonic()
            try:
                self._cl_after_schedule(output, scheduled_at, ts, now)
            except Exception:
                self._cl_fail("after_schedule")
            self.hook_seconds += time.monotonic() - t0
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._cl_active:
            t0 = time.monotonic()
            try:
                self._cl_after_update(scheduler_output, outputs)
            except Exception:
                self._cl_fail("update_from_output")
            self.hook_seconds += time.monotonic() - t0
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        if self._cl_active and finished:
            try:
                ts, now = time.time(), time.monotonic()
                for request in finished:
                    st = self._cl_states.get(request.request_id)
                    if st is None:
                        continue
                    if st.cutoff is not None:
                        self._cl_finish(request.request_id, st, "cutoff", st.cutoff, ts, now)
                    else:
                        reason = _STATUS_FINISH.get(finished_status, "abort")
                        self._cl_finish(request.request_id, st, reason, None, ts, now)
            except Exception:
                self._cl_fail("finish_requests")
        return finished

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            exporter = self._cl_exporter
            if exporter is not None:
                try:
                    exporter.shutdown(exporter.config.shutdown_timeout_s)
                except Exception:
                    self._cl_fail("shutdown")

    # -- before schedule: commands and policies ---------------------------------------------------

    def _cl_before_schedule(self, now: float, ts: float) -> int | None:
        if self._cl_inbox:
            self._cl_apply_commands(now, ts)
        if self._cl_unmatched and self._cl_step % 256 == 0:
            self._cl_expire_unmatched(now)
        opts = self.options
        guarded = bool(self._cl_protected or opts.preempt_escape_after)
        if self._cl_marked or guarded:
            self._cl_reorder()
        if guarded or opts.kv_idle_victim:
            running = self.running
            if type(running) is not _RunningList:
                running = self.running = _RunningList(running)
            running.chooser = self._cl_choose_victim
        elif type(self.running) is _RunningList:
            self.running.chooser = None
        self._cl_alone = False
        if opts.admission_arrivals_first and self._cl_hold_for_arrivals():
            cap = None  # the long prefill sits this step out: no cap for the arrivals
            if opts.admission_reserve:
                self._cl_order_waiting(now)
        else:
            cap = self._cl_admission_cap(now) if opts.admission_reserve else None
        if self._cl_marked:
            promoted = self._cl_yield_tokens()
            if promoted:
                room = max(self.options.admission_min_chunk, self.max_num_scheduled_tokens - promoted)
                cap = room if cap is None else min(cap, room)
        if cap is None:
            return None
        if self._cl_alone:
            # vLLM ignores long_prefill_token_threshold when one request is eligible ("nobody to
            # starve"); the step target still holds (arrivals wait for the step): cap the budget.
            self._cl_budget_restore = self.max_num_scheduled_tokens
            self.max_num_scheduled_tokens = min(cap, self.max_num_scheduled_tokens)
            return None
        old = self.scheduler_config.long_prefill_token_threshold
        self.scheduler_config.long_prefill_token_threshold = min(cap, old) if old else cap
        return int(old)

    def _cl_apply_commands(self, now: float, ts: float) -> None:
        inbox = self._cl_inbox
        while inbox:
            command = inbox.popleft()
            if command.id in self._cl_applied:
                continue
            targets = [
                rid
                for rid in self._cl_by_ext.get(command.request_id, ())
                if (req := self.requests.get(rid)) is not None and not req.is_finished()
            ]
            if not targets:
                parked = self._cl_unmatched.setdefault(command.request_id, [])
                if len(parked) < 16 and len(self._cl_unmatched) < 1024:
                    parked.append((now, command))
                continue
            self._cl_applied[command.id] = None
            if len(self._cl_applied) > _APPLIED_MEMORY:
                self._cl_applied.popitem(last=False)
            self._e_cutoff(ts, command.request_id, command.id, command.action, command.rule)
            for rid in targets:
                self._cl_apply(rid, command)

    def _cl_apply(self, rid: str, command: Command) -> None:
        st = self._cl_states.get(rid)
        if st is None:
            return
        action = command.action
        if action == "abort":
            request = self.requests[rid]
            reason = f"chunkledger:{command.rule}"
            st.cutoff = reason
            client = request.client_index
            self.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            self._cl_abort_outputs.append(
                (
                    client,
                    EngineCoreOutput(
                        request_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT, stop_reason=reason
                    ),
                )
            )
        elif action == "non_preemptible":
            if not st.non_preemptible:
                st.non_preemptible = True
                self._cl_protected += 1
        elif action in ("slow_pool", "promote"):
            was = st.slow or st.promoted
            st.slow, st.promoted = action == "slow_pool", action == "promote"
            if not was:
                self._cl_marked += 1

    def _cl_expire_unmatched(self, now: float) -> None:
        for ext in list(self._cl_unmatched):
            kept = [(t, c) for t, c in self._cl_unmatched[ext] if now - t < _UNMATCHED_TTL_S]
            if kept:
                self._cl_unmatched[ext] = kept
            else:
                del self._cl_unmatched[ext]

    def _cl_reorder(self) -> None:
        """Order the queues for the commands and the escape valve before vLLM schedules.

        Running: protected requests (non_preemptible, past the escape valve) first, so that a victim
        can always be found after them; then promoted ones and slow_pool ones that starved for
        ``slow_pool_every`` steps; then the rest; then those whose escape-valve protection ran out this
        step (back at the end, where vLLM put them when they resumed, so FCFS picks them again); other
        slow_pool ones last. Waiting: promoted first, slow_pool last (unless starved).
        """
        states = self._cl_states
        every = self.options.slow_pool_every
        predicted = self.options.preempt_escape_for == "predicted"
        ranked: list[tuple[int, Any]] = []
        moved = slow_running = False
        for req in self.running:
            st = states.get(req.request_id)
            rank = 2
            if st is not None:
                lapsed = False
                if predicted and st.escape_until is not None and req.num_output_tokens >= st.escape_until:
                    st.escape_until = None
                    self.escape_lapses += 1
                    lapsed = True
                if st.non_preemptible or self._cl_escaped(req, st):
                    rank = 0
                elif st.promoted or (st.slow and st.sat_out >= every):
                    rank = 1
                elif st.slow:
                    rank = 4
                elif lapsed:
                    rank = 3
                slow_running = slow_running or st.slow
            moved = moved or (bool(ranked) and rank < ranked[-1][0])
            ranked.append((rank, req))
        self._cl_slow_running = slow_running
        if moved:
            ranked.sort(key=lambda x: x[0])  # stable: FCFS order within a rank
            self.running[:] = [req for _, req in ranked]
        if not self._cl_marked:
            return
        waiting = self.waiting
        if isinstance(waiting, deque) and len(waiting) > 1:
            first: list[Any] = []
            normal: list[Any] = []
            last: list[Any] = []
            for req in waiting:
                st = states.get(req.request_id)
                if st is None or not (st.slow or st.promoted):
                    normal.append(req)
                elif st.promoted or st.sat_out >= every:
                    first.append(req)
                else:
                    st.sat_out += 1  # a step it yielded its place in the queue
                    last.append(req)
            if first or last:
                waiting.clear()
                waiting.extend(first + normal + last)

    def _cl_escaped(self, req: Any, st: _ReqState | None) -> bool:
        """Whether the escape valve protects ``req`` now."""
        n = self.options.preempt_escape_after
        if not n:
            return False
        if self.options.preempt_escape_for == "predicted":
            return st is not None and st.escape_until is not None
        return bool(req.num_preemptions >= n)

    def _cl_escape_grant(self, req: Any, st: _ReqState, n: int) -> None:
        """``"predicted"`` mode, at a preemption: protect it once it has been preempted ``n`` more
        times since the last protection, for its predicted remaining output."""
        if req.num_preemptions < max(st.escape_next, n):
            return
        produced = req.num_output_tokens
        until = produced + self.output_lengths.remaining(produced, req.max_tokens)
        st.escape_until = until
        st.escape_next = req.num_preemptions + n
        self.escape_grants.append(EscapeGrant(st.ext, req.num_preemptions, produced, until))

    def _cl_protected_req(self, req: Any) -> bool:
        st = self._cl_states.get(req.request_id)
        if st is not None and st.non_preemptible:
            return True
        return self._cl_escaped(req, st)

    def _cl_choose_victim(self, running: list[Any]) -> Any:
        """The request vLLM's FCFS loop should preempt, or None for vLLM's own choice (the last).

        Candidates are the request being allocated and those after it in ``running`` (not yet
        scheduled this step). Protected requests (non_preemptible, or past the escape valve) are
        skipped; when every other candidate is protected the request being allocated yields itself.
        With ``kv_idle_victim`` the candidate idle longest is chosen, else the last one.
        """
        try:
            current = self._cl_current
            start = next((i for i in range(len(running)) if running[i] is current), None)
            if start is None:
                return None
            others = running[start + 1 :]
            if not others:
                return None
            eligible = [r for r in others if not self._cl_protected_req(r)]
            if not eligible:
                return None if self._cl_protected_req(current) else current
            if not self.options.kv_idle_victim:
                return eligible[-1]
            states = self._cl_states
            best, best_t = eligible[-1], float("inf")
            for req in reversed(eligible):  # ties go to the later request, as in vLLM
                st = states.get(req.request_id)
                t = st.last_active if st is not None else float("inf")
                if t < best_t:
                    best, best_t = req, t
            return best
        except Exception:
            self._cl_fail("choose_victim")
            return None

    def _cl_yield_tokens(self) -> int:
        """Budget the commands ask running prefills to leave to waiting requests this step.

        The promoted requests at the head of the waiting queue, or, while a slow_pool request runs,
        the first waiting request that is not slow_pool. 0: nothing to leave.
        """
        states = self._cl_states
        need = 0
        for req in self.waiting:
            st = states.get(req.request_id)
            if st is not None and st.promoted:
                need += max(req.num_tokens - req.num_computed_tokens, 1)
                continue
            if self._cl_slow_running and not (st is not None and st.slow):
                need += max(req.num_tokens - req.num_computed_tokens, 1)
            break
        return need

    def _cl_admission_cap(self, now: float) -> int | None:
        """This step's cap on prefill chunks (applied as long_prefill_token_threshold), None for none.

        Orders the waiting queue first: aged and preempted requests first (arrival order), then the
        shortest prompt first. Then the reserve is what the other requests can take in this step,
        at most ``admission_reserve * budget`` (:meth:`_cl_others_demand`); the cap is the budget
        minus that, so a long running prefill gives up only tokens somebody will use. With
        ``admission_depth_tokens`` and a reserve in use, the cap is also divided by
        ``1 + depth / admission_depth_tokens`` at the deepest running prefill.
        """
        opts = self.options
        if len(self.waiting) + len(self.kv_holding_waiting) + len(self.running) <= 1:
            return self._cl_alone_cap() if opts.admission_step_target_s else None
        self._cl_order_waiting(now)
        budget = self.max_num_scheduled_tokens
        demand, deepest, work, whole = self._cl_others_walk(int(budget * opts.admission_reserve))
        if demand <= 0:
            # nobody else can run this step: the prefill keeps the whole budget, save the step target
            return self._cl_alone_cap() if opts.admission_step_target_s else None
        cap = float(budget - demand)
        if opts.admission_depth_tokens and deepest > 0:
            cap = cap / (1.0 + deepest / opts.admission_depth_tokens)
        if opts.admission_step_target_s:
            fit = self.step_times.max_chunk(opts.admission_step_target_s, demand, work, max(deepest, 0))
            if fit is not None and fit < cap:
                cap = fit
                self.step_caps.append(
                    (self._cl_step, max(deepest, 0), max(opts.admission_min_chunk, int(cap), whole))
                )
        # The cap is vLLM's long_prefill_token_threshold, which applies to every request: never
        # below the largest other prefill that runs whole this step (splitting a short prompt would
        # cost its TTFT a step; the long prefill gives up its extra tokens in the next steps).
        return max(opts.admission_min_chunk, int(cap), whole)

    def _cl_order_waiting(self, now: float) -> None:
        """The reserve's queue order: aged and preempted requests first (arrival order), then the
        shortest prompt first."""
        waiting = self.waiting
        if not isinstance(waiting, deque) or len(waiting) <= 1:
            return
        aging = self.options.admission_aging_s
        states = self._cl_states

        def key(req: Any) -> tuple[int, float]:
            st = states.get(req.request_id)
            aged = st is None or req.status != RequestStatus.WAITING or now - st.queued_t >= aging
            return (0, st.queued_t if st is not None else 0.0) if aged else (1, req.num_tokens)

        ordered = sorted(waiting, key=key)
        waiting.clear()
        waiting.extend(ordered)

    def _cl_hold_for_arrivals(self) -> bool:
        """Arrivals first: when short prompts wait and can all be admitted, leave the largest running
        prefill out of this step (put back after ``schedule()``, its KV kept), so the arrivals' first
        step is short: a short's TTFT is then the step it arrived in plus its own, not two long-prompt
        steps. Never two steps in a row, so the long prefill runs at least every other step."""
        if self._cl_held_last:
            self._cl_held_last = False
            return False
        waiting = self.waiting
        running = self.running
        if not waiting or len(running) + len(waiting) >= self.max_num_running_reqs:
            return False
        half = self.max_num_scheduled_tokens // 2
        if any(r.num_tokens - r.num_computed_tokens > half for r in waiting):
            return False  # a long prompt waits too: no arrivals-only step
        big, big_need = None, half
        for i, req in enumerate(running):
            if req.is_prefill_chunk:
                need = req.num_tokens - req.num_computed_tokens
                if need > big_need:
                    big, big_need = (i, req), need
        if big is None:
            return False
        running.pop(big[0])
        self._cl_held = big
        self._cl_held_last = True
        self.arrival_steps += 1
        return True

    def _cl_alone_cap(self) -> int | None:
        """The step target's cap on a prefill that is the only request that can run this step (a
        request may arrive at any moment and waits for the step to end), None when none binds."""
        opts = self.options
        req = next((r for r in self.running if r.is_prefill_chunk), None)
        if req is None:
            req = next(iter(self.kv_holding_waiting), None) or next(iter(self.waiting), None)
        if req is None:
            return None
        need = req.num_tokens - req.num_computed_tokens
        fit = self.step_times.max_chunk(opts.admission_step_target_s, 0, 0.0, req.num_computed_tokens)
        if fit is None or fit >= min(need, self.max_num_scheduled_tokens):
            return None
        cap = max(opts.admission_min_chunk, fit)
        self.step_caps.append((self._cl_step, req.num_computed_tokens, cap))
        self._cl_alone = True
        return cap

    def _cl_others_demand(self, most: int) -> tuple[int, int]:
        """(tokens that the requests other than the largest prefill can take this step, at most
        ``most``; the depth of the deepest running prefill, -1 for none): see :meth:`_cl_others_walk`."""
        demand, deepest, _, _ = self._cl_others_walk(most)
        return demand, deepest

    def _cl_others_walk(self, most: int) -> tuple[int, int, float, int]:
        """(tokens that the requests other than the largest prefill can take this step, at most
        ``most``; the depth of the deepest running prefill, -1 for none; the attention work of those
        tokens, :func:`engine_hooks.vllm.predict.attention_work`; the largest whole prompt among them of
        at most half the budget, which a cap must not split, 0 for none).

        Walked in vLLM's order: running requests (a decode's one token plus speculative ones, another
        prefill's remaining chunk), then waiting requests (those holding KV first, then the queue as
        ordered) while a running slot is free and their next chunk fits the free KV cache left after
        the running requests' allocations; vLLM stops at the first waiting request that does not
        fit, so the walk does too. The largest prefill among them (running or waiting) is the one the
        cap is for, and is not counted.
        """
        budget = self.max_num_scheduled_tokens
        needs: list[int] = []
        depths: list[int] = []  # where each need starts, negative for a decode
        big = big_at = -1
        deepest = -1
        for req in self.running:
            computed = req.num_computed_tokens
            need = req.num_tokens_with_spec + req.num_output_placeholders - computed
            if need <= 0:
                continue
            if req.is_prefill_chunk:
                deepest = max(deepest, computed)
                if need > big:
                    big, big_at = need, len(needs)
                depths.append(computed)
            else:
                depths.append(-1 - computed)
            needs.append(need)
        slots = getattr(self, "max_num_active_reqs", self.max_num_running_reqs) - len(self.running)
        slots -= getattr(self, "num_waiting_for_streaming_input", 0)
        if slots > 0 and (self.waiting or self.kv_holding_waiting):
            try:
                free = self.kv_cache_manager.block_pool.get_num_free_blocks() * int(self.block_size)
            except AttributeError:
                free = 1 << 62
            free -= min(sum(needs), budget)  # what the running requests allocate first
            room = budget + most  # enough of the queue to fill the reserve
            for req in (*self.kv_holding_waiting, *self.waiting):
                if slots <= 0 or room <= 0:
                    break
                need = req.num_tokens - req.num_computed_tokens
                if need <= 0:
                    continue
                chunk = min(need, budget)
                if chunk > free:
                    break
                free -= chunk
                slots -= 1
                room -= chunk
                if need > big:
                    big, big_at = need, len(needs)
                needs.append(need)
                depths.append(req.num_computed_tokens)
        demand = 0
        work = 0.0
        whole = 0
        for i, need in enumerate(needs):
            if i != big_at:
                take = min(need, most - demand)
                at = depths[i]
                if at >= 0:
                    work += attention_work(take, at)
                    if need <= budget // 2:  # a short prompt, which the cap must not split
                        whole = max(whole, need)
                else:
                    work += attention_work(take, -1 - at, False)
                demand += take
                if demand >= most:
                    return most, deepest, work, whole
        return demand, deepest, work, whole

    # -- after schedule: what the step runs --------------------------------------------------------

    def _cl_after_schedule(self, output: Any, now: float, ts: float, started: float) -> None:
        """``now``: when vLLM began scheduling (waits end there); ``started``: when ``schedule()`` was
        called (the step's start)."""
        states = self._cl_states
        step = self._cl_step
        self._cl_step = step + 1
        escape = self.options.preempt_escape_after
        predicted = self.options.preempt_escape_for == "predicted"
        for rid in output.preempted_req_ids:
            st = states.get(rid)
            if st is None or st.state == _PREEMPTED:
                continue
            if st.pending:
                self._cl_flush(rid, st, ts)
            req = self.requests.get(rid)
            self._e_preempted(ts, st.ext, st.blocks, st.computed)
            st.state = _PREEMPTED
            st.waiting_since = now
            st.out_at_preempt = req.num_output_tokens if req is not None else st.output
            st.blocks = 0
            if req is not None and escape and predicted:
                self._cl_escape_grant(req, st, escape)
        scheduled = output.num_scheduled_tokens
        if not scheduled:
            self._cl_steps[id(output)] = ()
            return
        spec = output.scheduled_spec_decode_tokens
        requests = self.requests
        blocks_of = self._cl_blocks
        chunk_rows = []
        ids = []
        prefill_tokens = decode_tokens = n_prefill = n_decode = depth = max_depth = 0
        work = 0.0  # attention work, for the step-time fit
        for rid, n in scheduled.items():
            st = states.get(rid)
            req = requests.get(rid)
            if st is None or req is None:
                continue
            ext = st.ext
            ids.append(ext)
            computed = req.num_computed_tokens
            before = computed - n
            st.last_active = now
            st.sat_out = 0
            if st.state != _RUNNING:
                if st.state == _PREEMPTED:
                    self._e_resumed(ts, ext, now - st.waiting_since, before, st.out_at_preempt)
                st.state = _RUNNING
            blocks = st.blocks = blocks_of(rid, computed)
            st.computed = computed
            if before < req.num_prompt_tokens or (n > 1 and rid not in spec):
                hw = st.hw
                first = st.chunks == 0
                chunk_rows.append(
                    (
                        ts,
                        ext,
                        step,
                        n,
                        before,
                        (min(computed, hw) - before) if hw > before else 0,
                        before if first else 0,
                        blocks,
                        req.num_preemptions,
                        _vllm_stamp(req, _SCHEDULED, now) - st.queued_t if first else None,
                    )
                )
                st.chunks += 1
                prefill_tokens += n
                n_prefill += 1
                depth += n * before
                work += n * (before + n / 2.0)
                if before > max_depth:
                    max_depth = before
            else:
                decode_tokens += n
                n_decode += 1
                work += n * before
            if computed > st.hw:
                st.hw = computed
        if chunk_rows:
            self._e_chunk.many(chunk_rows)
        stalled_ids = []
        stalled_blocks = []
        for req in self.running:
            rid = req.request_id
            if rid in scheduled:
                continue
            st = states.get(rid)
            if st is not None and st.blocks:
                st.sat_out += 1
                stalled_ids.append(st.ext)
                stalled_blocks.append(st.blocks)
        n_running, n_waiting = self.get_request_counts()
        usage = self.kv_cache_manager.usage
        self._cl_steps[id(output)] = (
            ts,
            step,
            started,
            prefill_tokens,
            decode_tokens,
            n_prefill,
            n_decode,
            n_running,
            n_waiting,
            0.0 if usage < 0 else 1.0 if usage > 1 else float(usage),
            ids,
            depth,
            max_depth,
            stalled_ids,
            stalled_blocks,
            work,
        )
        if len(self._cl_steps) > 64:  # outputs never passed back (should not happen): forget them
            del self._cl_steps[next(iter(self._cl_steps))]

    # -- after update: tokens, finishes, the step --------------------------------------------------

    def _cl_after_update(self, scheduler_output: Any, outputs: dict[int, Any]) -> None:
        ts = time.time()
        now = time.monotonic()
        states = self._cl_states
        pending = self._cl_pending
        keep_ids = self.options.token_ids
        flush_n = self.options.tokens_flush
        for eco in outputs.values():
            for out in eco.outputs:
                rid = out.request_id
                st = states.get(rid)
                if st is None:
                    continue
                new = out.new_token_ids
                if new:
                    if not st.pending:
                        st.pending_first_ts = ts
                        pending[rid] = st
                    if keep_ids:
                        st.pending.extend(new)
                    else:
                        st.pending.extend([0] * len(new))
                    st.output += len(new)
                if out.finish_reason is not None:
                    stop = out.stop_reason
                    reason = _FINISH.get(out.finish_reason, "stop")
                    if stop is None and out.finish_reason == FinishReason.REPETITION:
                        stop = "repetition"
                    self._cl_finish(rid, st, reason, None if stop is None else str(stop), ts, now)
                elif len(st.pending) >= flush_n:
                    self._cl_flush(rid, st, ts)
        if pending:
            oldest = ts - self.options.tokens_flush_s
            for rid, st in list(pending.items()):
                if st.pending_first_ts <= oldest:
                    self._cl_flush(rid, st, ts)
        if self._cl_abort_outputs:
            for client, out in self._cl_abort_outputs:
                eco = outputs.get(client)
                if eco is None:
                    outputs[client] = EngineCoreOutputs(outputs=[out])
                else:
                    eco.outputs.append(out)
            self._cl_abort_outputs = []
        info = self._cl_steps.pop(id(scheduler_output), None)
        if info:
            duration = max(now - info[2], 0.0)
            self._e_step(info[0], info[1], duration, *info[3:15])
            if self.options.admission_step_target_s:
                self.step_times.add(info[3] + info[4], info[15], duration, info[12] if info[3] else 0)

    def _cl_flush(self, rid: str, st: _ReqState, ts: float) -> None:
        ids = st.pending
        st.pending = []
        self._cl_pending.pop(rid, None)
        self._e_tokens(
            ts,
            st.ext,
            len(ids),
            st.output,
            st.pending_first_ts,
            st.blocks,
            ids if self.options.token_ids else None,
        )

    def _cl_finish(
        self, rid: str, st: _ReqState, reason: str, stop: str | None, ts: float, now: float
    ) -> None:
        if st.pending:
            self._cl_flush(rid, st, ts)
        self._cl_states.pop(rid, None)
        ids = self._cl_by_ext.get(st.ext)
        if ids is not None:
            ids.discard(rid)
            if not ids:
                del self._cl_by_ext[st.ext]
        if st.non_preemptible:
            self._cl_protected -= 1
        if st.slow or st.promoted:
            self._cl_marked -= 1
        if reason in ("stop", "length") and st.output > 0:
            self.output_lengths.add(st.output)
        wait_s = now - st.waiting_since if st.state != _RUNNING else None
        self._e_finished(ts, st.ext, reason, st.output, stop, wait_s)


class LedgerScheduler(_LedgerHooks, Scheduler):
    """vLLM v1's ``Scheduler`` reporting to chunkledger.

    ``--scheduler-cls engine_hooks.vllm.LedgerScheduler``
    """


class AsyncLedgerScheduler(_LedgerHooks, AsyncScheduler):
    """vLLM v1's ``AsyncScheduler`` (the default with async scheduling) reporting to chunkledger."""


def iter_schedulers(llm: Any) -> Iterable[_LedgerHooks]:
    """The ledger schedulers of an in-process ``vllm.LLM`` (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = getattr(getattr(llm, "llm_engine", llm), "engine_core", None)
    core = getattr(core, "engine_core", core)
    scheduler = getattr(core, "scheduler", None)
    if isinstance(scheduler, _LedgerHooks):
        yield scheduler


__all__ = ["XARGS_KEY", "AsyncLedgerScheduler", "LedgerScheduler", "external_request_id", "iter_schedulers"]
