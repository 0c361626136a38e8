"""One simulated vLLM v1 engine: scheduled by the model of vLLM's scheduler it shares with the what-if
replay (:mod:`engine_hooks.scheduling`), timed by the scenario's step cost, runaways; it emits what the
plugin would."""

from __future__ import annotations

import queue
import random
from typing import TYPE_CHECKING, Protocol

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
from engine_hooks.fields import (
    CHUNK_FIELDS,
    CUTOFF_APPLIED_FIELDS,
    FINISHED_FIELDS,
    PREEMPTED_FIELDS,
    QUEUED_FIELDS,
    RESUMED_FIELDS,
    STEP_FIELDS,
    TOKENS_FIELDS,
)
from engine_hooks.scheduling.settings import SIMULATOR
from engine_hooks.simulation.scenario import Scenario, SimRequest, _new_prompt_tokens

if TYPE_CHECKING:
    from engine_hooks.exporter import Exporter
    from engine_hooks.scheduling.schedule import Scheduled

# The scheduling model (numpy) is imported when an engine is built or steps: `chunkledger --help`
# registers the simulate command through this module and stays quick.


class EngineHost(Protocol):
    """What an engine needs of the fleet it runs in: its clock, and where its requests' news go."""

    def ts(self, t: float) -> float:
        """The wall-clock timestamp of virtual time ``t``."""
        ...

    def on_first_token(self, req: SimRequest, t: float) -> None: ...

    def on_disconnect(self, req: SimRequest, t: float) -> None: ...

    def on_finished(self, req: SimRequest, t: float, reason: str) -> None: ...


class SimEngine:
    """One engine: a scheduler (waiting and running queues, a KV block pool), a step clock; emits
    engine events.

    The scheduler is vLLM's as :mod:`engine_hooks.scheduling` models it, with the simulator's
    departures (:data:`engine_hooks.scheduling.settings.SIMULATOR`); a step's time is the scenario's
    a + b x prefill tokens + c x prefill tokens x depth + d x decode requests.
    """

    def __init__(self, source_id: str, scenario: Scenario, exporter: Exporter, seed: int, fleet: EngineHost):
        self.id = source_id
        self.sc = scenario
        self.exporter = exporter
        self.rng = random.Random(seed)
        self.fleet = fleet
        from engine_hooks.scheduling.state import SchedulerState

        self.sched = SchedulerState(scenario.engine_settings(), SIMULATOR)
        self.by_slot: dict[int, SimRequest] = {}  # this engine's waiting and running requests
        self.by_id: dict[str, SimRequest] = {}
        self.step_no = 0
        self.busy = False
        self.emitted = 0
        self.commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.e_queued = exporter.emitter(Queued, *QUEUED_FIELDS)
        self.e_chunk = exporter.emitter(Chunk, *CHUNK_FIELDS)
        self.e_tokens = exporter.emitter(Tokens, *TOKENS_FIELDS)
        self.e_preempted = exporter.emitter(Preempted, *PREEMPTED_FIELDS)
        self.e_resumed = exporter.emitter(Resumed, *RESUMED_FIELDS)
        self.e_finished = exporter.emitter(Finished, *FINISHED_FIELDS)
        self.e_cutoff = exporter.emitter(CutoffApplied, *CUTOFF_APPLIED_FIELDS)
        self.e_step = exporter.emitter(Step, *STEP_FIELDS)

    @property
    def load(self) -> int:
        return len(self.sched.run) + len(self.sched.queue)

    def add(self, req: SimRequest, t: float) -> None:
        req.queued_t = req.waiting_since = t
        req.slot = self.sched.add(req.prompt_tokens, req.cached_tokens, req.arrived_t, request_id=req.id)
        self.by_slot[req.slot] = req
        self.by_id[req.id] = req
        # no front-end arrival time, default priority (the fields the plugin also sends)
        self.e_queued(self.fleet.ts(t), req.id, req.prompt_tokens, req.max_tokens, None, 0)
        self.emitted += 1

    def _blocks(self, req: SimRequest) -> int:
        """KV blocks ``req`` holds (a waiting request holds none)."""
        return self.sched.blocks(int(self.sched.comp[req.slot])) if self.sched.running(req.slot) else 0

    def apply_commands(self, t: float) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            req = self.by_id.get(command.request_id)
            if req is None or req.finished or command.action != "abort":
                continue
            req.cutoff = command
            self.e_cutoff(self.fleet.ts(t), req.id, command.id, command.action, command.rule)
            self.emitted += 1
            self._finish(req, t, "cutoff", f"chunkledger:{command.rule}")

    def _finish(self, req: SimRequest, t: float, reason: str, stop_reason: str | None) -> None:
        self._flush_tokens(req, t)
        was_waiting = not self.sched.running(req.slot)
        self.sched.abort(req.slot)
        del self.by_slot[req.slot], self.by_id[req.id]
        req.finished = True
        wait_s = t - req.waiting_since if was_waiting else None
        self.e_finished(self.fleet.ts(t), req.id, reason, req.output, stop_reason, wait_s)
        self.emitted += 1
        self.fleet.on_finished(req, t, reason)

    def _flush_tokens(self, req: SimRequest, t: float) -> None:
        if not req.pending_ids:
            return
        first = req.pending_first_t if req.pending_first_t is not None else t
        self.e_tokens(
            self.fleet.ts(t),
            req.id,
            len(req.pending_ids),
            req.output,
            self.fleet.ts(first),
            self._blocks(req),
            req.pending_ids,
        )
        self.emitted += 1
        req.pending_ids = []
        req.pending_first_t = None

    def step(self, t: float) -> float:
        """Schedule and 'run' one step starting at virtual time ``t``; returns its duration."""
        from engine_hooks.scheduling.schedule import advance, schedule

        self.apply_commands(t)
        scheduled = schedule(self.sched)
        self._report_schedule(scheduled, t)
        plan = [
            (self.by_slot[i], n, c)
            for i, n, c in zip(
                scheduled.idx.tolist(), scheduled.new.tolist(), scheduled.before.tolist(), strict=True
            )
        ]
        prefill_tokens, prefill_reqs, depth_work, max_depth = self._emit_chunks(plan, t)
        decode_reqs = len(plan) - prefill_reqs
        sc = self.sc
        duration = (
            sc.step_a_s + sc.step_b_s * prefill_tokens + sc.step_c_s * depth_work + sc.step_d_s * decode_reqs
        )
        samples = advance(self.sched, scheduled.idx, scheduled.new, scheduled.before, t)
        counts, totals, token_ids = self._sample(plan, samples.tolist(), t + duration)
        # Running requests left out of this step (the budget ran out) hold their KV with no progress.
        planned = set(scheduled.idx.tolist())
        stalled = [self.by_slot[i] for i in self.sched.run.tolist() if i not in planned]
        stalled_blocks = [self._blocks(r) for r in stalled]
        held = [k for k, b in enumerate(stalled_blocks) if b]
        usage = 1.0 - self.sched.free / sc.kv_blocks
        self.e_step(
            self.fleet.ts(t),
            self.step_no,
            duration,
            prefill_tokens,
            decode_reqs,
            prefill_reqs,
            decode_reqs,
            len(self.sched.run),
            len(self.sched.queue),
            min(max(usage, 0.0), 1.0),
            [req.id for req, _, _ in plan],
            depth_work,
            max_depth,
            [stalled[k].id for k in held],
            [stalled_blocks[k] for k in held],
            counts,
            totals,
            token_ids,
        )
        self.emitted += 1
        self.step_no += 1
        return duration

    def _report_schedule(self, scheduled: Scheduled, t: float) -> None:
        """The step's preemptions (each frees its KV; the request recomputes when it resumes), then the
        preempted requests it resumed."""
        ts = self.fleet.ts(t)
        for slot, held in scheduled.preempted:
            victim = self.by_slot[slot]
            self.e_preempted(ts, victim.id, self.sched.blocks(held), held)
            victim.lost_tokens = max(victim.lost_tokens, held)
            victim.waiting_since = t
        self.emitted += len(scheduled.preempted)
        if not scheduled.admitted:
            return
        preempts = self.sched.preempts
        for slot in scheduled.idx[len(scheduled.idx) - scheduled.admitted :].tolist():
            if preempts[slot]:
                req = self.by_slot[slot]
                self.e_resumed(ts, req.id, t - req.waiting_since, 0, req.output)
                self.emitted += 1

    def _emit_chunks(self, plan: list[tuple[SimRequest, int, int]], t: float) -> tuple[int, int, int, int]:
        """A chunk event per prefill pass of the step; returns its prefill tokens and requests, and the
        depth work (tokens x depth) and deepest start of its chunks."""
        ts = self.fleet.ts(t)
        rows = []
        prefill_tokens = prefill_reqs = depth_work = max_depth = 0
        blocks, preempts = self.sched.blocks, self.sched.preempts
        for req, n, computed in plan:
            if not req.prefilling(computed):
                continue
            prefill_reqs += 1
            prefill_tokens += n
            depth_work += n * computed
            max_depth = max(max_depth, computed)
            first = req.chunks == 0
            rows.append(
                (
                    ts,
                    req.id,
                    self.step_no,
                    n,
                    computed,
                    n - _new_prompt_tokens(req, computed, n),
                    req.cached_tokens if first else 0,  # prefix hits: first chunk only
                    blocks(computed + n),
                    int(preempts[req.slot]),
                    t - req.queued_t if first else None,
                )
            )
            req.chunks += 1
        if rows:
            self.e_chunk.many(rows)
            self.emitted += len(rows)
        return prefill_tokens, prefill_reqs, depth_work, max_depth

    def _sample(
        self, plan: list[tuple[SimRequest, int, int]], samples: list[bool], end: float
    ) -> tuple[list[int], list[int], list[int]]:
        """The step's tokens at its ``end`` (a pass that completes its sequence samples one, a partial
        prefill none), and the requests they finish; with ``step_tokens`` the step's columns
        (per plan entry: tokens, running total; the token ids), else coalesced tokens events."""
        in_step = self.sc.step_tokens
        counts: list[int] = []
        totals: list[int] = []
        token_ids: list[int] = []
        for (req, _, _), sampled in zip(plan, samples, strict=True):
            if not sampled:
                if in_step:
                    counts.append(0)
                    totals.append(req.output)
                continue
            token = req.next_token(self.rng)
            if in_step:
                counts.append(1)
                totals.append(req.output + 1)
                token_ids.append(token)
            else:
                req.pending_ids.append(token)
            if req.pending_first_t is None:
                req.pending_first_t = end
            req.output += 1
            if req.first_token_t is None:
                req.first_token_t = end
                self.fleet.on_first_token(req, end)
            if req.disconnect_at is not None and req.output >= req.disconnect_at:
                self.fleet.on_disconnect(req, end)
                self._finish(req, end, "abort", "client_disconnected")
            elif req.output >= req.target_output:
                capped = req.max_tokens is not None and req.output >= req.max_tokens
                self._finish(req, end, "length" if capped or req.runaway else "stop", None)
            elif not in_step and len(req.pending_ids) >= self.sc.tokens_flush:
                self._flush_tokens(req, end)
        return counts, totals, token_ids


__all__ = ["EngineHost", "SimEngine"]
