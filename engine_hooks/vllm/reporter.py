"""What the vLLM plugin reports, per engine step and per request (all through one
:class:`engine_hooks.exporter.Exporter`, in the field orders of :mod:`engine_hooks.fields`):

* ``queued`` when the scheduler receives a request (``arrival_ts`` is the front end's arrival time);
* ``chunk`` for every prefill slice scheduled (first pass, and recompute passes after a preemption,
  whose ``recomputed_tokens`` are the positions the request had computed before), with its depth
  (``computed_before``), prefix-cache hits on the first chunk and the request's KV blocks;
* ``preempted`` / ``resumed`` (with the output tokens it had, so the ledger can tell a prefill wait
  from a decode wait);
* output tokens, with their ids unless ``token_ids`` is off: as ``tokens`` events coalesced per
  request (every ``tokens_flush`` tokens or ``tokens_flush_s`` seconds, and at finish or preemption),
  or with ``step_tokens`` on the ``step`` event, one entry per request that ran (``token_counts``,
  ``token_totals``, ``token_ids``: one event per step, however many requests decode);
* ``finished`` with vLLM's finish reason (``cutoff`` for the ledger's aborts);
* ``step``: its duration (below), prefill and decode counts, queue sizes, KV usage, the requests that
  ran, prefill depth work, and the requests that held KV blocks but sat the step out (``stalled_*``),
  and (``step_tokens``) their new tokens.

Between ``schedule()`` and ``update_from_output()`` a step is kept as a :class:`StepRecord`.

A step's duration is what it cost the engine's cadence: from its start, the later of its
``schedule()`` call and the previous step's completion, to its completion (the end of its
``update_from_output()``); the ``step`` event's ``ts`` is the wall clock at that start, so ``ts +
duration_s`` is the completion and the ledger's ``interval_s`` runs from one completion to the next.
In lock-step (async scheduling off: vLLM on CPU) a step is scheduled after the previous one completed,
so it runs from its ``schedule()`` call, scheduling included, as the engine waits for it. With async
scheduling (vLLM's default on GPU) the engine core schedules step N+1 while the device runs step N, so
N+1 starts when N completes: while the batch queue is full, the duration is the interval between
consecutive completions, the device's time for the step; the first step after the engine idled runs
from its ``schedule()`` call. (From ``schedule()`` to ``update_from_output()`` would count the step
before it too: about twice the device time.)
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple, cast

from vllm.v1.request import Request

from engine_hooks import fields
from engine_hooks.events import Chunk, CutoffApplied, Finished, Preempted, Queued, Resumed, Step, Tokens
from engine_hooks.exporter import Emitter, Exporter
from engine_hooks.vllm import compat
from engine_hooks.vllm.compat import QUEUED, SCHEDULED, vllm_stamp
from engine_hooks.vllm.folding import OutputFolder
from engine_hooks.vllm.state import PREEMPTED, RUNNING, HookState, ReqState
from engine_hooks.vllm.tracing import request_trace


class StepRecord(NamedTuple):
    """One step as ``schedule()`` left it, until its ``update_from_output()`` sends the ``step`` event.

    The fields from ``prefill_tokens`` to ``stalled_kv_blocks`` are the event's, in its order."""

    ts: float  # wall clock at schedule()
    step: int
    started: float  # clock when schedule() was called: the step starts here or at the previous one's end
    prefill_tokens: int
    decode_tokens: int
    num_prefill_reqs: int
    num_decode_reqs: int
    running: int
    waiting: int
    kv_usage: float
    request_ids: list[str]
    prefill_depth_tokens: int
    max_prefill_depth: int
    stalled_request_ids: list[str]
    stalled_kv_blocks: list[int]
    work: float  # attention work of the step's tokens (predict.attention_work), for the step-time fit
    rids: list[str]  # step_tokens: vLLM's ids of request_ids, same order (to find who got no token)
    outputs: list[int]  # output tokens each of them had when the step was scheduled (with async
    # scheduling the previous step's may still be due): a total for one that got none and is gone


class _NullEmitter:
    """Stands in for an exporter emitter when no ledger is configured."""

    def __call__(self, *values: Any) -> None:
        pass

    def many(self, rows: Any) -> None:
        pass


class Reporter(HookState):
    """The reporting, a mixin of the scheduler classes (its state lives on the scheduler)."""

    # Reporting on (an exporter or a stand-in is set). Off on the class too: a scheduler built without
    # __init__ (vLLM's own tests build some with object.__new__) schedules as plain vLLM.
    _cl_active: bool = False
    _cl_exporter: Exporter | None = None
    _cl_pending: dict[str, ReqState]  # requests with output tokens not yet sent
    _cl_new: list[tuple[str, str, int, int]]  # step_tokens: (id, ext, new tokens, total) per output
    _cl_new_ids: list[int]  # step_tokens: their new ids, in the same order
    _cl_steps: dict[int, StepRecord | None]  # id(SchedulerOutput) -> its step, None: nothing ran
    _cl_done: float  # clock at the last step's completion (its update_from_output)
    _cl_kv: dict[str, list[Any]] | None  # compat.block_lists
    _cl_block_size: int
    _cl_fast: bool  # the fast path for decodes is on (see _cl_report_schedule)
    # Folds the steps' outputs off the engine thread (.folding); None on a scheduler built without
    # __init__ (its hooks take no lock).
    _cl_folder: OutputFolder | None = None
    _cl_lock: Any = contextlib.nullcontext()  # the folder's lock
    _e_queued: Emitter
    _e_chunk: Emitter
    _e_tokens: Emitter
    _e_preempted: Emitter
    _e_resumed: Emitter
    _e_finished: Emitter
    _e_step: Emitter

    def _cl_init_reporter(self) -> None:
        self._cl_active = False
        self._cl_exporter = None
        self._cl_states = {}
        self._cl_by_ext = {}
        self._cl_pending = {}
        self._cl_new = []
        self._cl_new_ids = []
        self._cl_steps = {}
        self._cl_done = float("-inf")
        self._cl_step = 0
        self._cl_kv = compat.block_lists(self)
        self._cl_block_size = compat.block_size(self)
        self._cl_fast = self._cl_kv is not None and compat.CAN_HOOK_PREEMPTION
        self._cl_folder = OutputFolder(self._cl_report_outputs, self._cl_fail, "chunkledger-fold")
        self._cl_lock = self._cl_folder.lock

    # -- the exporter -------------------------------------------------------------------------------

    def use_exporter(self, exporter: Exporter | None) -> None:
        """Send events through ``exporter`` from now on (None: stop reporting; commands still apply).

        The exporter's ``on_command`` should be :meth:`submit_command`. The previous exporter is not
        shut down here (it gets the outputs still held back).
        """
        self._cl_fold()
        self._cl_exporter = exporter
        if exporter is None:
            null = cast(Emitter, _NullEmitter())
            self._e_queued = self._e_chunk = self._e_tokens = self._e_preempted = null
            self._e_resumed = self._e_finished = self._e_cutoff = self._e_step = null
        else:
            e = exporter.emitter
            self._e_queued = e(Queued, *fields.QUEUED_FIELDS, "trace_id", "parent_span_id")
            self._e_chunk = e(Chunk, *fields.CHUNK_FIELDS)
            self._e_tokens = e(Tokens, *fields.TOKENS_FIELDS)
            self._e_preempted = e(Preempted, *fields.PREEMPTED_FIELDS)
            self._e_resumed = e(Resumed, *fields.RESUMED_FIELDS)
            self._e_finished = e(Finished, *fields.FINISHED_FIELDS)
            self._e_cutoff = e(CutoffApplied, *fields.CUTOFF_APPLIED_FIELDS)
            self._e_step = e(Step, *fields.STEP_FIELDS)
            hold_back = getattr(exporter, "hold_back", None)  # a stand-in (the profiler's recorder) may not
            if hold_back is not None:
                hold_back(self._cl_fold)
        self._cl_active = True

    def _cl_fold(self) -> None:
        """Fold the steps' outputs still held back (:mod:`.folding`), on this thread."""
        folder = self._cl_folder
        if folder is not None and len(folder):
            folder.drain()

    @property
    def exporter(self) -> Exporter | None:
        return self._cl_exporter

    # -- per request ----------------------------------------------------------------------------------

    def _cl_report_queued(self, request: Request, ext: str, now: float, ts: float) -> None:
        """``add_request``: keep the request (keyed ``ext``) and send ``queued``."""
        queued_t = vllm_stamp(request, QUEUED, now)
        self._cl_track(request.request_id, ReqState(ext, request.client_index, queued_t))
        arrival = request.arrival_time
        self._e_queued(
            ts,
            ext,
            request.num_prompt_tokens,
            request.max_tokens,
            arrival if arrival and arrival > 0 else None,
            request.priority,
            *request_trace(request),
        )

    def _cl_report_finished(self, finished: list[Request], status: Any) -> None:
        """``finish_requests``: requests finished outside the model's outputs (aborts)."""
        ts, now = time.time(), self.clock()
        for request in finished:
            st = self._cl_states.get(request.request_id)
            if st is None:
                continue
            if st.cutoff is not None:
                self._cl_finish(request.request_id, st, "cutoff", st.cutoff, ts, now)
            else:
                reason = compat.STATUS_FINISH.get(status, "abort")
                self._cl_finish(request.request_id, st, reason, None, ts, now)

    def _cl_flush(self, rid: str, st: ReqState, ts: float) -> None:
        ids = st.pending
        st.pending = []
        self._cl_pending.pop(rid, None)
        self._e_tokens(
            ts,
            st.ext,
            len(ids),
            st.output,
            st.pending_first_ts,
            st.held,
            ids if self.options.token_ids else None,
        )

    def _cl_finish(
        self, rid: str, st: ReqState, reason: str, stop: str | None, ts: float, now: float
    ) -> None:
        if st.pending:
            self._cl_flush(rid, st, ts)
        self._cl_forget(rid, st, reason)
        wait_s = now - st.waiting_since if st.state != RUNNING else None
        self._e_finished(ts, st.ext, reason, st.output, stop, wait_s)

    # -- after schedule(): what the step runs ---------------------------------------------------------

    def _cl_preempting(self, request: Request) -> None:
        """vLLM is about to preempt ``request`` (reset its computed tokens, free its blocks): a decode on
        the fast path keeps its computed tokens for the ``preempted`` event and the recompute's chunks."""
        st = self._cl_states.get(request.request_id)
        if st is not None and st.fast:
            st.fast = False
            computed = st.computed = request.num_computed_tokens
            if computed > st.hw:
                st.hw = computed

    def _cl_report_schedule(self, output: Any, now: float, ts: float, started: float) -> None:
        """``now``: when vLLM began scheduling (waits end there); ``started``: when ``schedule()`` was
        called (the step's start). Sends the preemptions and the chunks; keeps the step's record.

        The fast path: a running request that decoded in an earlier step and decodes again (one token,
        or its speculative tokens) is only counted. Its blocks are the length of vLLM's own block list
        (``ReqState.kv``), its computed tokens are read when vLLM preempts it (:meth:`_cl_preempting`),
        and a streaming-input session never takes it. Off while the step-time fit
        (``admission_step_target_s``) needs every request's attention work, or when vLLM's block lists
        or preemption method cannot be reached (:mod:`.compat`).
        """
        step = self._cl_step
        self._cl_step = step + 1
        if output.preempted_req_ids:
            self._cl_report_preempted(output.preempted_req_ids, now, ts)
        scheduled = output.num_scheduled_tokens
        record = self._cl_step_record(output, step, now, ts, started) if scheduled else None
        self._cl_steps[id(output)] = record
        if len(self._cl_steps) > 64:  # outputs never passed back (should not happen): forget them
            del self._cl_steps[next(iter(self._cl_steps))]

    def _cl_step_record(self, output: Any, step: int, now: float, ts: float, started: float) -> StepRecord:
        """The step's record (its ``step`` event once its outputs are in); sends its chunks."""
        states = self._cl_states
        scheduled = output.num_scheduled_tokens
        spec = output.scheduled_spec_decode_tokens
        requests = self.requests
        fast = self._cl_fast and not self.options.admission_step_target_s
        chunk_rows: list[tuple[Any, ...]] = []
        ids: list[str] = []
        rids: list[str] = []  # with step_tokens only (the default path pays nothing for them)
        outs: list[int] = []
        in_step = self.options.step_tokens
        prefill_tokens = decode_tokens = n_prefill = n_decode = depth = max_depth = 0
        work = 0.0  # attention work, for the step-time fit
        for rid, n in scheduled.items():
            st = states.get(rid)
            if st is None:
                continue
            if st.fast and (n == 1 or rid in spec):
                decode_tokens += n
                n_decode += 1
            else:
                req = requests.get(rid)
                if req is None:
                    continue
                before = self._cl_place(st, req, n, rid in spec, step, ts, now, fast, chunk_rows)
                if before is not None:  # a prefill chunk
                    prefill_tokens += n
                    n_prefill += 1
                    depth += n * before
                    work += n * (before + n / 2.0)
                    if before > max_depth:
                        max_depth = before
                else:
                    decode_tokens += n
                    n_decode += 1
                    work += n * (st.computed - n)
            ids.append(st.ext)
            if in_step:
                rids.append(rid)
                outs.append(st.output)
            st.last_active = now  # for the policies: the KV-idle victim, slow_pool's starvation
            st.sat_out = 0
        if chunk_rows:
            self._e_chunk.many(chunk_rows)
        stalled_ids, stalled_blocks = self._cl_stalled(scheduled)
        n_running, n_waiting = self.get_request_counts()
        usage = self.kv_cache_manager.usage
        return StepRecord(
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
            rids,
            outs,
        )

    def _cl_report_preempted(self, preempted: Any, now: float, ts: float) -> None:
        """Send a ``preempted`` event for each request vLLM preempted while scheduling this step."""
        states = self._cl_states
        for rid in preempted:
            st = states.get(rid)
            if st is None or st.state == PREEMPTED:
                continue
            if st.pending:
                self._cl_flush(rid, st, ts)
            req = self.requests.get(rid)
            self._e_preempted(ts, st.ext, st.held, st.computed)
            st.state = PREEMPTED
            st.fast = False
            st.waiting_since = now
            st.out_at_preempt = req.num_output_tokens if req is not None else st.output
            st.blocks = 0
            st.kv = None

    def _cl_place(
        self,
        st: Any,
        req: Any,
        n: int,
        speculative: bool,
        step: int,
        ts: float,
        now: float,
        fast: bool,
        chunk_rows: list[tuple[Any, ...]],
    ) -> int | None:
        """A request scheduled ``n`` tokens off the fast path: its state brought up to date (resumed,
        its blocks and computed tokens), its chunk row added when it runs a prefill chunk. Returns where
        the chunk starts (its computed tokens before it); None for a decode."""
        computed = req.num_computed_tokens
        before = computed - n
        if st.state != RUNNING:
            if st.state == PREEMPTED:
                self._e_resumed(ts, st.ext, now - st.waiting_since, before, st.out_at_preempt)
            st.state = RUNNING
        kv = None
        kv_lists = self._cl_kv
        if kv_lists is not None:
            kv = st.kv = kv_lists.get(req.request_id)
            blocks = len(kv) if kv is not None else 0
        else:
            blocks = st.blocks = -(-computed // self._cl_block_size)
        st.computed = computed
        hw = st.hw
        if computed > hw:
            st.hw = computed
        if before < req.num_prompt_tokens or (n > 1 and not speculative):
            first = st.chunks == 0
            chunk_rows.append(
                (
                    ts,
                    st.ext,
                    step,
                    n,
                    before,
                    (min(computed, hw) - before) if hw > before else 0,
                    before if first else 0,
                    blocks,
                    req.num_preemptions,
                    vllm_stamp(req, SCHEDULED, now) - st.queued_t if first else None,
                )
            )
            st.chunks += 1
            st.fast = False
            return before
        st.fast = fast and kv is not None and not st.streamed
        return None

    def _cl_stalled(self, scheduled: Any) -> tuple[list[str], list[int]]:
        """The running requests this step left out that hold KV blocks (their KV sits idle), and the
        blocks each holds."""
        stalled_ids: list[str] = []
        stalled_blocks: list[int] = []
        if len(self.running) == len(scheduled):  # every request scheduled is running: none sat out
            return stalled_ids, stalled_blocks
        states = self._cl_states
        for req in self.running:
            rid = req.request_id
            if rid in scheduled:
                continue
            st = states.get(rid)
            if st is not None:
                blocks = st.held
                if blocks:
                    st.sat_out += 1
                    stalled_ids.append(st.ext)
                    stalled_blocks.append(blocks)
        return stalled_ids, stalled_blocks

    # -- after update_from_output(): tokens, finishes, the step ---------------------------------------

    def _cl_report_outputs(self, outputs: list[list[Any]], ts: float, now: float) -> None:
        """A step's new tokens (kept for its step event with ``step_tokens``, else coalesced:
        :meth:`_cl_flush`) and finished requests. ``outputs``: the ``EngineCoreOutput`` lists of
        ``update_from_output()``'s result, one per front end."""
        get = self._cl_states.get
        pending = self._cl_pending
        keep_ids = self.options.token_ids
        flush_n = self.options.tokens_flush
        in_step = self.options.step_tokens
        new_rows, new_ids = self._cl_new, self._cl_new_ids
        for outs in outputs:
            for out in outs:
                rid = out.request_id
                st = get(rid)
                if st is None:
                    continue
                new = out.new_token_ids
                if new:
                    n = len(new)
                    st.output += n
                    if in_step:
                        new_rows.append((rid, st.ext, n, st.output))
                        if keep_ids:
                            new_ids += new
                    else:
                        held = st.pending
                        if not held:
                            st.pending_first_ts = ts
                            pending[rid] = st
                        held += new if keep_ids else [0] * n
                if out.finish_reason is not None:
                    self._cl_output_finished(out, st, ts, now)
                elif new and not in_step and len(st.pending) >= flush_n:
                    self._cl_flush(rid, st, ts)
        if pending:
            # Oldest first: a request enters ``pending`` with its first unsent token and leaves it when
            # they are sent, so the dict's order is that of pending_first_ts.
            oldest = ts - self.options.tokens_flush_s
            while pending:
                rid, st = next(iter(pending.items()))
                if st.pending_first_ts > oldest:
                    break
                self._cl_flush(rid, st, ts)

    def _cl_output_finished(self, out: Any, st: ReqState, ts: float, now: float) -> None:
        stop = out.stop_reason
        if stop is None and out.finish_reason == compat.REPETITION:
            stop = "repetition"
        reason = compat.FINISH.get(out.finish_reason, "stop")
        self._cl_finish(out.request_id, st, reason, None if stop is None else str(stop), ts, now)

    def _cl_report_step(self, scheduler_output: Any, now: float) -> None:
        """Send the ``step`` event of ``scheduler_output``, completed at ``now`` (and feed its duration
        to the step-time fit when admission_step_target_s uses it)."""
        rec = self._cl_steps.pop(id(scheduler_output), None)
        rows, ids = self._cl_new, self._cl_new_ids
        self._cl_new, self._cl_new_ids = [], []
        if rec is None:
            return
        start = rec.started if rec.started >= self._cl_done else self._cl_done  # the module docstring
        self._cl_done = now
        duration = max(now - start, 0.0)
        request_ids = rec.request_ids
        counts: list[int] = []
        totals: list[int] = []
        if self.options.step_tokens:
            # The requests that got tokens in the order of the outputs (their columns came with them, one
            # pass), then those that got none (a partial prefill) with their totals when scheduled.
            request_ids, counts, totals = [], [], []
            if rows:
                _, ext, n, total = zip(*rows, strict=True)
                request_ids, counts, totals = list(ext), list(n), list(total)
            if len(rows) != len(rec.rids):
                got = {row[0] for row in rows}
                for rid, e, before in zip(rec.rids, rec.request_ids, rec.outputs, strict=True):
                    if rid not in got:
                        request_ids.append(e)
                        counts.append(0)
                        totals.append(before)
        self._e_step(
            rec.ts + (start - rec.started),
            rec.step,
            duration,
            rec.prefill_tokens,
            rec.decode_tokens,
            rec.num_prefill_reqs,
            rec.num_decode_reqs,
            rec.running,
            rec.waiting,
            rec.kv_usage,
            request_ids,
            rec.prefill_depth_tokens,
            rec.max_prefill_depth,
            rec.stalled_request_ids,
            rec.stalled_kv_blocks,
            counts,
            totals,
            ids,
        )
        if self.options.admission_step_target_s:
            prefill = rec.prefill_tokens
            self.step_times.add(
                prefill + rec.decode_tokens, rec.work, duration, rec.max_prefill_depth if prefill else 0
            )


__all__ = ["Reporter", "StepRecord"]
