"""The plugin's optional scheduling policies (all off by default; :mod:`engine_hooks.vllm.options`).

Applied before vLLM's ``schedule()`` on the engine thread, and undone after it:

* the commands' marks (:mod:`.commands`): ``non_preemptible`` requests first in the running queue,
  ``promote`` ones first in both queues (running prefills leave them room), ``slow_pool`` ones last
  (first once every ``slow_pool_every`` steps they starved);
* the preemption escape valve (``preempt_escape_after``, ``preempt_escape_for``) and the KV-idle victim
  (``kv_idle_victim``): which running request vLLM's FCFS loop preempts;
* the admission reserve (``admission_reserve``, ``admission_aging_s``, ``admission_depth_tokens``,
  ``admission_step_target_s``, ``admission_arrivals_first``): a per-step cap on prefill chunks so the
  other requests that can run in the step get their tokens.

The mechanics inside vLLM (the victim hook, the chunk cap, the held request) are in :mod:`.compat`.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

from vllm.v1.request import RequestStatus

from engine_hooks.vllm import compat
from engine_hooks.vllm.predict import OutputLengths, StepTimes, attention_work
from engine_hooks.vllm.state import PREEMPTED, HookState, ReqState


class EscapeGrant(NamedTuple):
    """One protection by the escape valve in ``"predicted"`` mode (``scheduler.escape_grants``)."""

    request_id: str  # external id
    preemptions: int  # its preemptions when protected
    output_tokens: int  # output tokens it had then
    until: int  # protected until it has this many output tokens


class Policies(HookState):
    """The policies, a mixin of the scheduler classes (their state lives on the scheduler)."""

    escape_grants: deque[EscapeGrant]
    escape_lapses: int
    step_caps: deque[tuple[int, int, int]]
    arrival_steps: int
    _cl_slow_running: bool
    _cl_alone: bool
    _cl_budget_restore: int | None = None  # (class defaults: see Reporter._cl_active)
    _cl_held: tuple[int, Any] | None = None
    _cl_held_last: bool

    def _cl_init_policies(self) -> None:
        self._cl_slow_running = False  # a slow_pool request is in the running queue
        self._cl_current = None  # the request being allocated (victim choice)
        self.output_lengths = OutputLengths()  # finished output lengths: the escape valve's predictor
        self.escape_grants = deque(maxlen=1024)  # "predicted" protections, newest last
        self.escape_lapses = 0  # "predicted" protections that ran out before the request finished
        self.step_times = StepTimes()  # measured step durations: admission_step_target_s's predictor
        self.step_caps = deque(maxlen=4096)  # (step, depth, cap) of the steps whose chunk cap came
        # from admission_step_target_s, newest last
        self._cl_alone = False  # this step's cap is for a prefill running alone (set by the cap)
        self._cl_budget_restore = None  # the token budget to restore after schedule()
        self._cl_held = None  # (index, request) left out of running this step
        self._cl_held_last = False  # the previous step left the long prefill out (arrivals first)
        self.arrival_steps = 0  # steps that left a long prefill out for arrivals (arrivals first)
        # The reserve and the commands set long_prefill_token_threshold per step: on a private copy.
        compat.private_scheduler_config(self)

    # -- around schedule() ------------------------------------------------------------------------

    def _cl_policies_read_outputs(self) -> bool:
        """Whether this step's policies read what folding the outputs keeps (finishes, output counts):
        schedule() then folds the outputs held back first (:mod:`.folding`)."""
        return bool(self._cl_marked or self._cl_protected or self.options.reorders)

    def _cl_apply_policies(self, now: float, throttle_prefills: bool = False) -> int | None:
        """Before ``schedule()``: order the queues, set the victim choice and this step's chunk cap.
        Returns the chunk threshold to restore after it (:meth:`_cl_undo_policies`), None for none.

        A step in which vLLM holds every prefill back (its prefill cadence, or the data-parallel
        throttle ``throttle_prefills``: :func:`compat.prefills_held`) gets no cap and holds nothing out
        for arrivals, who cannot be admitted in it either."""
        opts = self.options
        guarded = bool(self._cl_protected or opts.preempt_escape_after)
        if self._cl_marked or guarded:
            self._cl_reorder()
        if guarded or opts.kv_idle_victim:
            compat.set_victim_chooser(self, self._cl_choose_victim)
        elif compat.victim_chooser_set(self):
            compat.set_victim_chooser(self, None)
        self._cl_alone = False
        if (opts.admission_reserve or opts.admission_arrivals_first) and compat.prefills_held(
            self, throttle_prefills
        ):
            cap = None
        elif opts.admission_arrivals_first and self._cl_hold_for_arrivals():
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
            self._cl_budget_restore = compat.cap_budget(self, cap)
            return None
        return compat.cap_chunks(self, cap)

    def _cl_undo_policies(self, restore: int | None) -> None:
        """After ``schedule()`` (also when it raised): what :meth:`_cl_apply_policies` changed."""
        if restore is not None:
            compat.restore_chunks(self, restore)
        if self._cl_budget_restore is not None:
            compat.restore_budget(self, self._cl_budget_restore)
            self._cl_budget_restore = None
        if self._cl_held is not None:
            index, held = self._cl_held
            self._cl_held = None
            compat.put_back(self, index, held)

    # -- the commands' marks and the escape valve: queue order and victim choice -------------------

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

    def _cl_escaped(self, req: Any, st: ReqState | None) -> bool:
        """Whether the escape valve protects ``req`` now."""
        n = self.options.preempt_escape_after
        if not n:
            return False
        if self.options.preempt_escape_for == "predicted":
            return st is not None and st.escape_until is not None
        return bool(req.num_preemptions >= n)

    def _cl_grant_escapes(self, preempted: Any, n: int) -> None:
        """``"predicted"`` mode, after ``schedule()``: the requests it preempted (not those already
        preempted before) may be protected (:meth:`_cl_escape_grant`)."""
        states = self._cl_states
        for rid in preempted:
            st = states.get(rid)
            if st is None or st.state == PREEMPTED:
                continue
            req = self.requests.get(rid)
            if req is not None:
                self._cl_escape_grant(req, st, n)

    def _cl_escape_grant(self, req: Any, st: ReqState, n: int) -> None:
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

    # -- the admission reserve ----------------------------------------------------------------------

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
        steps. Never two steps in a row, so the long prefill runs at least every other step. A prefill
        whose LoRA no other running request uses stays in (:func:`compat.can_hold_out`)."""
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
        big, big_need = -1, half
        for i, req in enumerate(running):
            if req.is_prefill_chunk:
                need = req.num_tokens - req.num_computed_tokens
                if need > big_need and compat.can_hold_out(self, req):
                    big, big_need = i, need
        if big < 0:
            return False
        self._cl_held = (big, compat.hold_out(self, big))
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
        prefill's remaining chunk; nothing for one whose tokens in flight finish it), then waiting
        requests (those holding KV first, then the queue as ordered) while a running slot is free
        and their next chunk fits the free KV cache left after
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
            if need <= 0 or compat.finishes_in_flight(req):
                continue
            if req.is_prefill_chunk:
                deepest = max(deepest, computed)
                if need > big:
                    big, big_at = need, len(needs)
                depths.append(computed)
            else:
                depths.append(-1 - computed)
            needs.append(need)
        slots = compat.free_slots(self)
        if slots > 0 and (self.waiting or self.kv_holding_waiting):
            free = compat.free_kv_tokens(self)
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


__all__ = ["EscapeGrant", "Policies"]
