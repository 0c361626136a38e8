"""What the plugin's hooks keep between engine steps: per-request state and the attributes that the
reporter, the commands and the policies share on the scheduler.

:class:`HookState` is the common base of their mixins (:mod:`.reporter`, :mod:`.commands`,
:mod:`.policies`): it declares, for the type checker, every attribute more than one of them reads, and
holds the request lifecycle they share (:meth:`HookState._cl_track`, :meth:`HookState._cl_forget`).
The attributes are set in :meth:`engine_hooks.vllm.scheduler.LedgerScheduler.__init__`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

    from engine_hooks.events import Command
    from engine_hooks.exporter import Emitter
    from engine_hooks.vllm.options import LedgerOptions
    from engine_hooks.vllm.predict import OutputLengths, StepTimes

    _Base = Scheduler
else:
    _Base = object

log = logging.getLogger("engine_hooks.vllm.scheduler")

WAITING, RUNNING, PREEMPTED = 0, 1, 2  # ReqState.state


class ReqState:
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
        "fast",
        "hw",
        "kv",
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
        "streamed",
        "waiting_since",
    )

    def __init__(self, ext: str, client: int, now: float):
        self.ext = ext
        self.client = client
        self.queued_t = self.waiting_since = self.last_active = now
        self.state = WAITING
        self.chunks = 0  # prefill chunks reported so far
        self.hw = 0  # high-water mark of computed tokens (positions recomputed after a preemption)
        self.computed = 0  # computed tokens after its last scheduled step (see fast)
        self.blocks = 0  # KV blocks held after its last scheduled step, when kv is None
        # vLLM's own list of the request's KV blocks (compat.block_list), live while it holds them and
        # left as it was when vLLM freed them: its length is the blocks held, with nothing to update.
        self.kv: list[Any] | None = None
        # A decode the reporter takes on its fast path (reporter.Reporter._cl_report_schedule): its
        # computed tokens and high-water mark are taken at its preemption, not every step.
        self.fast = False
        self.streamed = False  # a streaming-input session: every step takes the full path
        self.output = 0  # output tokens so far
        self.out_at_preempt = 0
        self.pending: list[int] = []  # output token ids not yet sent
        self.pending_first_ts = 0.0
        self.sat_out = 0  # consecutive steps it held KV (or waited, for slow_pool) without running
        self.cutoff: str | None = None  # stop reason of an abort command being applied
        self.escape_next = 0  # preemptions at which the escape valve ("predicted") next protects it
        self.escape_until: int | None = None  # protected by it until this many output tokens
        self.non_preemptible = self.slow = self.promoted = False

    @property
    def held(self) -> int:
        """KV blocks it holds after its last scheduled step (when vLLM freed them: held then)."""
        kv = self.kv
        return len(kv) if kv is not None else self.blocks


class HookState(_Base):
    """The shared attributes of the scheduler's hooks (see the module docstring)."""

    # The engine's monotonic clock in seconds, for every stamp the hooks take (waits, step starts and
    # ends). A test may give one scheduler a controlled clock (``scheduler.clock = fake.now``).
    clock: Callable[[], float] = time.monotonic
    hook_errors: int  # exceptions caught in the hooks (each place is logged once)
    options: LedgerOptions
    output_lengths: OutputLengths  # finished output lengths: the escape valve's predictor
    step_times: StepTimes  # measured step durations: admission_step_target_s's predictor
    _cl_logged: set[str]
    _cl_states: dict[str, ReqState]  # vLLM request id -> its state
    _cl_by_ext: dict[str, set[str]]  # external id -> the vLLM request ids keyed by it
    _cl_step: int  # the next step's number
    _cl_current: Any  # the request vLLM is allocating KV for (compat.track_allocations)
    _cl_marked: int  # requests marked slow_pool or promote (reordering needed)
    _cl_protected: int  # requests marked non_preemptible
    _cl_inbox: deque[Command]  # commands received, applied at the next schedule()
    _e_cutoff: Emitter

    def _cl_fail(self, where: str) -> None:
        self.hook_errors += 1
        if where not in self._cl_logged:
            self._cl_logged.add(where)
            log.error("chunkledger: hook %s failed; the engine goes on (logged once)", where, exc_info=True)

    def _cl_track(self, rid: str, st: ReqState) -> None:
        """Start keeping ``st`` for vLLM's request ``rid``."""
        self._cl_states[rid] = st
        ids = self._cl_by_ext.get(st.ext)
        if ids is None:
            self._cl_by_ext[st.ext] = {rid}
        else:
            ids.add(rid)

    def _cl_forget(self, rid: str, st: ReqState, reason: str) -> None:
        """The request finished (``reason``, the ledger's): drop its state and its marks, and let the
        escape valve's predictor learn its output length."""
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


__all__ = ["PREEMPTED", "RUNNING", "WAITING", "HookState", "ReqState"]
