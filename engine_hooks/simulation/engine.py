"""One simulated vLLM v1 engine: scheduling under a token budget, chunked prefill, KV blocks and
preemption, runaways; it emits what the plugin would."""

from __future__ import annotations

import queue
import random
from collections import deque
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from engine_hooks.exporter import Exporter
    from engine_hooks.simulation.fleet import Fleet

from engine_hooks.simulation.scenario import BLOCK_TOKENS, Scenario, SimRequest, _new_prompt_tokens


class SimEngine:
    """One engine: waiting and running queues, a KV block pool, a step clock; emits engine events."""

    def __init__(self, source_id: str, scenario: Scenario, exporter: Exporter, seed: int, fleet: Fleet):
        self.id = source_id
        self.sc = scenario
        self.exporter = exporter
        self.rng = random.Random(seed)
        self.fleet = fleet
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.free_blocks = scenario.kv_blocks
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
        return len(self.waiting) + len(self.running)

    def add(self, req: SimRequest, t: float) -> None:
        req.queued_t = req.waiting_since = t
        self.waiting.append(req)
        # no front-end arrival time, default priority (the fields the plugin also sends)
        self.e_queued(self.fleet.ts(t), req.id, req.prompt_tokens, req.max_tokens, None, 0)
        self.emitted += 1

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // BLOCK_TOKENS)

    def _preempt(self, victim: SimRequest, t: float) -> None:
        self.running.remove(victim)
        self.free_blocks += victim.blocks
        self.e_preempted(self.fleet.ts(t), victim.id, victim.blocks, victim.computed)
        self.emitted += 1
        victim.blocks = 0
        victim.lost_tokens = max(victim.lost_tokens, victim.computed)
        victim.computed = 0  # recomputed on resume (no prefix cache for its own output here)
        victim.preemptions += 1
        victim.waiting_since = t
        victim.state = "waiting"
        self.waiting.appendleft(victim)

    def _allocate(self, req: SimRequest, new_tokens: int, t: float, planned: set[str]) -> bool:
        """Blocks for ``new_tokens`` more tokens, preempting the newest running request not yet
        scheduled this step when the pool is short; False when there is none left to preempt."""
        need = self._blocks_for(req.computed + new_tokens) - req.blocks
        while need > self.free_blocks:
            victims = [r for r in self.running if r is not req and r.id not in planned]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: r.arrived_t), t)
        self.free_blocks -= max(need, 0)
        req.blocks += max(need, 0)
        return True

    def apply_commands(self, t: float) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            req = self.fleet.requests.get(command.request_id)
            if req is None or req.finished or command.action != "abort":
                continue
            req.cutoff = command
            self.e_cutoff(self.fleet.ts(t), req.id, command.id, command.action, command.rule)
            self.emitted += 1
            self._finish(req, t, "cutoff", f"chunkledger:{command.rule}")

    def _finish(self, req: SimRequest, t: float, reason: str, stop_reason: str | None) -> None:
        self._flush_tokens(req, t)
        was_waiting = req.state == "waiting"
        if was_waiting:
            self.waiting.remove(req)
        elif req.state == "running":
            self.running.remove(req)
        req.state = "done"
        self.free_blocks += req.blocks
        req.blocks = 0
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
            req.blocks,
            req.pending_ids,
        )
        self.emitted += 1
        req.pending_ids = []
        req.pending_first_t = None

    def step(self, t: float) -> float:
        """Schedule and 'run' one step starting at virtual time ``t``; returns its duration."""
        sc = self.sc
        self.apply_commands(t)
        budget = sc.max_num_batched_tokens
        # vLLM (0.32) caps a prefill chunk at long_prefill_token_threshold only when another request is
        # running or waiting: a request alone has nobody to leave the budget to
        eligible = len(self.running) + len(self.waiting)
        cap = sc.long_prefill_token_threshold if sc.long_prefill_token_threshold and eligible > 1 else budget
        plan: list[tuple[SimRequest, int]] = []
        chunk_rows = []
        ts = self.fleet.ts(t)
        planned: set[str] = set()
        for req in list(self.running):
            if req.state != "running" or budget <= 0:
                continue
            n = min(req.prompt_tokens + req.output - req.computed, budget, cap) if req.prefilling else 1
            if not self._allocate(req, n, t, planned):
                self._preempt(req, t)
                continue
            budget -= n
            plan.append((req, n))
            planned.add(req.id)
        while self.waiting and budget > 0 and len(self.running) < sc.max_num_seqs:
            req = self.waiting[0]
            if req.preemptions == 0 and req.chunks == 0 and req.computed == 0:
                req.computed = req.cached_tokens
            n = min(req.prompt_tokens + req.output - req.computed, budget, cap)
            if not self._allocate(req, n, t, planned):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.state = "running"
            planned.add(req.id)
            if req.preemptions:
                self.e_resumed(ts, req.id, t - req.waiting_since, 0, req.output)
                self.emitted += 1
            budget -= n
            plan.append((req, n))
        prefill_tokens = decode_reqs = prefill_reqs = 0
        depth_work = max_depth = 0
        for req, n in plan:
            if req.prefilling:
                prefill_reqs += 1
                prefill_tokens += n
                depth_work += n * req.computed
                max_depth = max(max_depth, req.computed)
                wait_s = t - req.queued_t if req.chunks == 0 else None
                chunk_rows.append(
                    (
                        ts,
                        req.id,
                        self.step_no,
                        n,
                        req.computed,
                        n - _new_prompt_tokens(req, n),
                        req.cached_tokens if req.chunks == 0 else 0,  # prefix hits: first chunk only
                        req.blocks,
                        req.preemptions,
                        wait_s,
                    )
                )
                req.chunks += 1
            else:
                decode_reqs += 1
        duration = (
            sc.step_a_s + sc.step_b_s * prefill_tokens + sc.step_c_s * depth_work + sc.step_d_s * decode_reqs
        )
        if chunk_rows:
            self.e_chunk.many(chunk_rows)
            self.emitted += len(chunk_rows)
        end = t + duration
        in_step = sc.step_tokens
        counts: list[int] = []  # the step's tokens, columnar (in_step): per plan entry
        totals: list[int] = []
        token_ids: list[int] = []
        for req, n in plan:
            if not req.finished:
                req.computed += n
            if req.finished or req.prefilling:  # a partial prefill produces no token
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
            elif not in_step and len(req.pending_ids) >= sc.tokens_flush:
                self._flush_tokens(req, end)
        running_ids = [req.id for req, _ in plan]
        # Running requests left out of this step (the budget ran out) hold their KV with no progress.
        stalled = [r for r in self.running if r.id not in planned and r.blocks]
        usage = 1.0 - self.free_blocks / sc.kv_blocks
        self.e_step(
            ts,
            self.step_no,
            duration,
            prefill_tokens,
            decode_reqs,
            prefill_reqs,
            decode_reqs,
            len(self.running),
            len(self.waiting),
            min(max(usage, 0.0), 1.0),
            running_ids,
            depth_work,
            max_depth,
            [r.id for r in stalled],
            [r.blocks for r in stalled],
            counts,
            totals,
            token_ids,
        )
        self.emitted += 1
        self.step_no += 1
        return duration
