"""Where the plugin reaches into vLLM's scheduler beyond the methods it overrides, in one place.

Tested against vLLM 0.32.0, 0.33.0 and 0.34.0 (:data:`TESTED`: the scheduler-level suite on each
release's own scheduler and engine core, async scheduling on and off, and vLLM's own scheduler tests
with the plugin's class in place; docs/vllm.md). Written against 0.32.0's
``vllm/v1/core/sched/scheduler.py``; each function says what it assumes, and those assumptions hold
in the whole range. A vLLM outside it logs one warning when the plugin loads.
When vLLM changes one of these structures, this module is the one to adapt. The two patches (the KV
allocation wrapper and the running list's victim choice) and the per-step overrides are undone or
harmless when the hooks are off; the readers fall back to something safe where they can.

Read directly elsewhere, on the hot path and by design (vLLM's scheduler interface):
``SchedulerOutput.num_scheduled_tokens`` / ``scheduled_spec_decode_tokens`` / ``preempted_req_ids``,
``EngineCoreOutput.new_token_ids`` / ``finish_reason`` / ``stop_reason``, and the request counters
(``num_computed_tokens``, ``num_prompt_tokens``, ``num_output_tokens``, ``num_preemptions``, ...).
Overridden beside the entry points: ``Scheduler._preempt_request`` (:data:`PREEMPT_METHOD`), to read a
request's computed tokens before vLLM resets them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any, SupportsIndex, cast

import vllm
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

# vLLM's finish reasons (EngineCoreOutput.finish_reason) and the statuses finish_requests() is given,
# as the ledger's finish reasons. vLLM 0.32: FinishReason STOP/LENGTH/ABORT/ERROR (REPETITION maps to
# "stop" with stop reason "repetition"); FINISHED_IGNORED is a prompt longer than the model allows.
FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}
REPETITION = FinishReason.REPETITION
STATUS_FINISH = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}
ABORTED = RequestStatus.FINISHED_ABORTED
QUEUED, SCHEDULED = EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED

TESTED = ((0, 32), (0, 34))  # the vLLM releases tested, first and last (major, minor), any patch
_log = logging.getLogger(__name__)


def release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (``0.33.0``, ``0.34.0+cu129``, ``0.32.0+cpu``)."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_version(version: str | None = None) -> bool:
    """Whether the vLLM loaded (or ``version``) is in the tested range; logs one warning naming the
    range when it is not (the plugin still loads: vLLM's scheduler interface is not public, and a
    release outside the range may have moved what this module reads)."""
    if version is None:
        version = str(getattr(vllm, "__version__", ""))
    found = release(version)
    if found is not None and TESTED[0] <= found <= TESTED[1]:
        return True
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED
    _log.warning(
        "chunkledger: vLLM %s is outside the range this plugin is tested on (%d.%d to %d.%d); "
        "its scheduler hooks may misreport or fail (each failure is counted and logged once)",
        version or "of unknown version",
        lo_major,
        lo_minor,
        hi_major,
        hi_minor,
    )
    return False


def async_scheduling(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` runs the engine core with async scheduling (its batch queue overlaps
    step N+1's ``schedule()`` with step N). Assumes ``scheduler_config.async_scheduling`` (vLLM 0.32 to
    0.34: resolved to a bool by ``VllmConfig`` before the scheduler is built)."""
    config = getattr(vllm_config, "scheduler_config", None)
    return bool(getattr(config, "async_scheduling", False))


# -- reads --------------------------------------------------------------------------------------------


def vllm_stamp(request: Request, kind: EngineCoreEventType, now: float) -> float:
    """vLLM's own monotonic stamp of what just happened to ``request`` (the last of its ``events``,
    recorded when vLLM logs stats: QUEUED in ``add_request``, SCHEDULED in ``schedule``), so that the
    waits measured here are the spans vLLM's ``request_queue_time_seconds`` reports; else ``now``.

    Assumes vLLM 0.32's ``Request.events``: ``record_event()`` appends an ``EngineCoreEvent(type,
    timestamp)`` (monotonic) only while the scheduler logs stats; ``take_events()`` empties it."""
    events = request.events
    if events:
        last = events[-1]
        if last.type == kind and abs(now - last.timestamp) < 1.0:
            return last.timestamp
    return now


def block_lists(scheduler: Any) -> dict[str, list[Any]] | None:
    """vLLM's request id -> the list of its KV blocks (the first KV cache group's), or None when it
    cannot be read (then the reporter counts blocks from computed tokens: :func:`block_size`).

    Assumes vLLM 0.32 to 0.34's ``KVCacheManager.coordinator.single_type_managers[0].req_to_blocks``:
    a dict that lives as long as the manager, whose list for a request is created at its first
    allocation, changed in place while it runs, and popped unchanged when vLLM frees the blocks
    (``pop_blocks_for_free``), so a reference kept to it tells the blocks held then."""
    try:
        table = scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
    except (AttributeError, IndexError):
        return None
    return cast(dict[str, list[Any]], table)


def block_size(scheduler: Any) -> int:
    return max(int(scheduler.block_size), 1)


# The scheduler method vLLM calls to preempt a request, before it resets the request's computed tokens
# (0.32 to 0.34: ``Scheduler._preempt_request(request, timestamp, drop_stale_output=False)``). Without
# it the reporter's fast path for decodes is off (it reads a decode's computed tokens there).
PREEMPT_METHOD = "_preempt_request"
CAN_HOOK_PREEMPTION = callable(getattr(Scheduler, PREEMPT_METHOD, None))


def free_kv_tokens(scheduler: Any) -> int:
    """Tokens the free KV blocks hold. Assumes ``KVCacheManager.block_pool.get_num_free_blocks()``
    and the scheduler's ``block_size`` (vLLM 0.32); unbounded when the pool cannot be read."""
    try:
        return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks()) * int(scheduler.block_size)
    except AttributeError:
        return 1 << 62


def finishes_in_flight(request: Any) -> bool:
    """Whether ``schedule()`` leaves this running request out because the tokens still in flight
    (async scheduling) already reach its ``max_tokens``. Assumes vLLM 0.32 to 0.34's test: output
    placeholders and ``num_computed_tokens + 2 - num_output_placeholders >= num_prompt_tokens +
    max_tokens``."""
    placeholders = getattr(request, "num_output_placeholders", 0)
    return bool(
        placeholders > 0
        and request.num_computed_tokens + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens
    )


def free_slots(scheduler: Any) -> int:
    """Running slots a waiting request can take this step. Assumes vLLM 0.32's admission test in
    ``schedule()``: ``len(running) + num_waiting_for_streaming_input < max_num_active_reqs`` (older
    versions: ``len(running) < max_num_running_reqs``)."""
    slots = getattr(scheduler, "max_num_active_reqs", scheduler.max_num_running_reqs) - len(scheduler.running)
    return int(slots - getattr(scheduler, "num_waiting_for_streaming_input", 0))


# -- patch 1: which request is being allocated -------------------------------------------------------


def track_allocations(scheduler: Any, on: bool) -> None:
    """While ``on``, the scheduler's ``kv_cache_manager.allocate_slots`` is wrapped so that
    ``scheduler._cl_current`` is the request vLLM is allocating KV for (the victim choice needs it);
    off, what was there before is called directly (a wrapper call per running request per step is
    only paid while a victim chooser is set). Only the plugin's own wrapper is ever removed: another
    one set on the instance (a test's patch) stays.

    Assumes vLLM 0.32's ``Scheduler.schedule()``: it calls ``self.kv_cache_manager.allocate_slots(
    request, ...)`` for each running request, looked up on the instance at every call, and preempts
    (``self.running.pop()``, patch 2) inside that request's allocation loop."""
    manager = scheduler.kv_cache_manager
    current = vars(manager).get("allocate_slots")
    ours = _TRACKING in getattr(current, "__dict__", {})
    if on == ours:
        return
    if not on:
        inner, was_set = current.__dict__[_TRACKING]
        if was_set:
            manager.allocate_slots = inner
        else:
            del manager.allocate_slots  # the class's method shows again
        return
    allocate = manager.allocate_slots

    def allocate_slots(request: Any, *a: Any, **kw: Any) -> Any:
        scheduler._cl_current = request
        return allocate(request, *a, **kw)

    allocate_slots.__dict__[_TRACKING] = (allocate, current is not None)
    manager.allocate_slots = allocate_slots


def _tracking(scheduler: Any) -> bool:
    current = vars(scheduler.kv_cache_manager).get("allocate_slots")
    return _TRACKING in getattr(current, "__dict__", {})


_TRACKING = "_cl_tracking"  # on the wrapper: (what it wraps, whether that was set on the instance)


# -- patch 2: the FCFS victim --------------------------------------------------------------------------


class RunningList(list):  # type: ignore[type-arg]
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


def set_victim_chooser(scheduler: Any, chooser: Callable[[list[Any]], Any] | None) -> None:
    """Let ``chooser(running)`` pick vLLM's preemption victim this step (None: vLLM's own, the last).

    Assumes vLLM 0.32's FCFS policy: the victim is ``self.running.pop()`` with no argument (after
    checking ``_request_blocks_can_be_freed(self.running[-1])``). vLLM rebinds ``self.running`` to a
    new plain list when it removes several requests at once (``remove_all``), so this is called
    before every ``schedule()``. While a chooser is set, allocations are tracked
    (:func:`track_allocations`)."""
    running = scheduler.running
    track_allocations(scheduler, chooser is not None)
    if chooser is not None:
        if type(running) is not RunningList:
            running = scheduler.running = RunningList(running)
        running.chooser = chooser
    elif type(running) is RunningList:
        running.chooser = None


def victim_chooser_set(scheduler: Any) -> bool:
    """Whether :func:`set_victim_chooser` left a chooser (or the allocation tracking) in place."""
    running = scheduler.running
    return _tracking(scheduler) or (type(running) is RunningList and running.chooser is not None)


# -- per-step overrides, undone after schedule() ---------------------------------------------------------


def private_scheduler_config(scheduler: Any) -> None:
    """Give the scheduler its own copy of ``scheduler_config``, since :func:`cap_chunks` changes it
    per step and vLLM 0.32 shares the object with the rest of the engine (``vllm_config``)."""
    scheduler.scheduler_config = copy.copy(scheduler.scheduler_config)


def cap_chunks(scheduler: Any, cap: int) -> int:
    """Cap every prefill chunk of the next ``schedule()`` at ``cap`` tokens; returns the threshold to
    restore after it.

    Assumes vLLM 0.32 reads ``scheduler_config.long_prefill_token_threshold`` once per ``schedule()``
    (0: no cap) and applies it to every request, but ignores it when only one request is eligible
    (then :func:`cap_budget` is the cap) and, with ``adaptive_long_prefill_threshold``, raises it to
    ``budget // eligible requests``."""
    config = scheduler.scheduler_config
    old = config.long_prefill_token_threshold
    config.long_prefill_token_threshold = min(cap, old) if old else cap
    return int(old)


def restore_chunks(scheduler: Any, old: int) -> None:
    scheduler.scheduler_config.long_prefill_token_threshold = old


def cap_budget(scheduler: Any, cap: int) -> int:
    """Cap the next ``schedule()``'s token budget at ``cap``; returns the budget to restore after it.
    Assumes vLLM 0.32 starts each ``schedule()`` from ``self.max_num_scheduled_tokens``."""
    old = int(scheduler.max_num_scheduled_tokens)
    scheduler.max_num_scheduled_tokens = min(cap, old)
    return old


def restore_budget(scheduler: Any, old: int) -> None:
    scheduler.max_num_scheduled_tokens = old


def prefills_held(scheduler: Any, throttle_prefills: bool) -> bool:
    """Whether the next ``schedule()`` holds every prefill back: no chunk runs and no request is
    admitted, only decodes.

    Assumes vLLM 0.32 to 0.34's ``schedule(throttle_prefills)``: it defers prefills while some running
    request decodes and ``prefill_capacity_bound`` is not set, when the data-parallel engine core
    throttles the step (``throttle_prefills``), or (0.33 and later) by the local prefill cadence:
    ``local_prefill_interval > 1`` (``prefill_schedule_interval`` without data parallelism) and fewer
    than that many executed steps since ``last_prefill_step``."""
    if getattr(scheduler, "prefill_capacity_bound", False):
        return False
    if not any(not r.is_prefill_chunk for r in scheduler.running):
        return False
    if throttle_prefills:
        return True
    interval = getattr(scheduler, "local_prefill_interval", 1)
    return bool(interval > 1 and scheduler.num_executed_steps + 1 - scheduler.last_prefill_step < interval)


def can_hold_out(scheduler: Any, request: Any) -> bool:
    """Whether :func:`hold_out` may take ``request`` out of one ``schedule()`` without letting vLLM
    exceed ``max_loras``: when LoRA is on and the request has one, only if another running request
    uses its LoRA too, or every waiting request's LoRA is the base model or one in use by the running
    requests (the held one's included).

    Assumes vLLM 0.32 to 0.34's ``schedule()``: before admitting waiting requests it collects the LoRA
    ids of every request in ``self.running`` and admits a request with another LoRA only while fewer
    than ``lora_config.max_loras`` are in use, then asserts that count at the next ``schedule()``. A
    held request whose LoRA nobody else counts frees a place that is not free once it is put back:
    harmless only when no waiting request could take it with a new LoRA."""
    if not getattr(scheduler, "lora_config", None):
        return True
    lora_id = _lora_id(request)
    if not lora_id:
        return True
    in_use = {_lora_id(other) for other in scheduler.running if other is not request}
    if lora_id in in_use:
        return True
    in_use.update((lora_id, 0))
    waiting = (*getattr(scheduler, "kv_holding_waiting", ()), *scheduler.waiting)
    return all(_lora_id(req) in in_use for req in waiting)


def _lora_id(request: Any) -> int:
    lora = getattr(request, "lora_request", None)
    return max(lora.lora_int_id, 0) if lora is not None else 0


def hold_out(scheduler: Any, index: int) -> Any:
    """Take the running request at ``index`` out of the next ``schedule()``, its KV kept; put it back
    with :func:`put_back`. Assumes vLLM 0.32 schedules only what is in ``self.running`` (in order)
    and frees KV only of requests it preempts or finishes."""
    return scheduler.running.pop(index)


def put_back(scheduler: Any, index: int, request: Any) -> None:
    running = scheduler.running
    running.insert(min(index, len(running)), request)


# -- outputs the engine did not produce --------------------------------------------------------------


def abort_output(rid: str, stop_reason: str) -> EngineCoreOutput:
    """The output that tells the front end its request was aborted with ``stop_reason``. Assumes vLLM
    0.32's front ends finish a request on an ``EngineCoreOutput`` with ``finish_reason=ABORT`` (the
    client sees ``finish_reason="abort"`` and ``stop_reason``)."""
    return EngineCoreOutput(
        request_id=rid, new_token_ids=[], finish_reason=FinishReason.ABORT, stop_reason=stop_reason
    )


def add_outputs(outputs: dict[int, Any], extra: list[tuple[int, EngineCoreOutput]]) -> None:
    """Append ``(client index, output)`` pairs to ``update_from_output()``'s result. Assumes vLLM
    0.32's: a dict client index -> ``EngineCoreOutputs``, each sent to that front end."""
    for client, out in extra:
        eco = outputs.get(client)
        if eco is None:
            outputs[client] = EngineCoreOutputs(outputs=[out])
        else:
            eco.outputs.append(out)


__all__ = [
    "ABORTED",
    "CAN_HOOK_PREEMPTION",
    "FINISH",
    "PREEMPT_METHOD",
    "QUEUED",
    "REPETITION",
    "SCHEDULED",
    "STATUS_FINISH",
    "TESTED",
    "RunningList",
    "abort_output",
    "add_outputs",
    "async_scheduling",
    "block_lists",
    "block_size",
    "can_hold_out",
    "cap_budget",
    "cap_chunks",
    "check_version",
    "finishes_in_flight",
    "free_kv_tokens",
    "free_slots",
    "hold_out",
    "prefills_held",
    "private_scheduler_config",
    "put_back",
    "release",
    "restore_budget",
    "restore_chunks",
    "set_victim_chooser",
    "track_allocations",
    "victim_chooser_set",
    "vllm_stamp",
]
