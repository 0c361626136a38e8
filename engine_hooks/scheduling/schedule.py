"""One ``Scheduler.schedule()`` of vLLM v1 (0.32) on a :class:`~engine_hooks.scheduling.state.
SchedulerState`, and the progress of a step that ran (:func:`advance`).

The step's chunk threshold: vLLM's ``long_prefill_token_threshold``, ignored when a single request is
running or waiting; with the plugin's admission reserve, capped further by
:func:`engine_hooks.scheduling.reserve.admission_cap` (:func:`chunk_threshold`).

Running requests first, in running order: each gets its remaining tokens (a prefill's rest, a
decode's 1), capped by the step's chunk threshold and by the budget left (none once the budget is
spent); then KV blocks for them. When the free pool cannot hold them a victim is preempted and the
allocation retried: FCFS takes the last running request; ``"kv-idle"`` (the plugin's
``kv_idle_victim``) the one, among those after the request being allocated (not yet scheduled this
step), whose last step is the oldest (ties to the later one), else itself; ``"priority"`` the running
request with the largest (priority, arrival), possibly one already scheduled this step (its tokens go
back to the budget). When the victim is the request being allocated, the running pass stops there.
A preempted request frees its KV, keeps the tokens it produced, and on resume recomputes prompt and
output beyond its prefix-cache hit.

In this model ``"kv-idle"`` always preempts the same request as FCFS: the running pass skips nobody
while budget is left, so whenever a running request is scheduled every one before it is too, and
the last one is always among the longest idle (ties go to the later). The plugin's choice differs in
a real engine only where its commands reorder the running queue or vLLM leaves a request out of a
step for reasons the model does not have (async scheduling's in-flight tokens, the encoder budget).

Waiting requests next, only in a step that preempted nobody, while a running slot is free and budget
is left: the queue's head computes from its prefix-cache hit; without chunked prefill a head whose
prompt does not fit the budget left stops admission; with ``reserve_full_isl`` its whole sequence
must fit the free KV, and its first chunk must; a head that does not fit stops admission.

:class:`~engine_hooks.scheduling.settings.Departures` changes three of these rules for a caller whose
model departs from vLLM (the simulator's).

Two implementations of the running pass give the same result: :func:`running_vector` (numpy, for the
common step where every allocation fits, which it detects) and :func:`running_exact` (a loop, for the
steps that preempt).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from engine_hooks.scheduling.reserve import admission_cap
from engine_hooks.scheduling.state import SchedulerState

Schedule = tuple[np.ndarray, np.ndarray, np.ndarray, int]  # request, new tokens, computed before; budget left
_EMPTY = np.zeros(0, dtype=np.int64)


class Scheduled(NamedTuple):
    """One step's schedule: who runs, how far, and who was preempted for it."""

    idx: np.ndarray  # the scheduled requests, in scheduling order (running ones, then admitted ones)
    new: np.ndarray  # tokens each computes in the step
    before: np.ndarray  # tokens each had computed before it (its chunk's depth)
    admitted: int  # the last ``admitted`` entries came from the waiting queue
    preempted: list[tuple[int, int]]  # (request, tokens of KV it held), in order of preemption


def schedule(st: SchedulerState, vectorized: bool = True) -> Scheduled:
    """One ``schedule()``: the chunk threshold, the running pass, then the waiting pass.

    ``vectorized`` (numpy for the running pass when no allocation fails) changes the speed only."""
    budget = st.settings.max_num_batched_tokens
    thr = chunk_threshold(st)
    preempted: list[tuple[int, int]] = []
    if len(st.run):
        sched = running_vector(st, thr, budget) if vectorized else None
        if sched is None:
            sched = running_exact(st, thr, budget, preempted)
        idx, new, before, left = sched
    else:
        idx, new, before, left = _EMPTY, _EMPTY, _EMPTY, budget
    admitted = 0
    if left > 0 and len(st.queue) and (not preempted or st.departures.admit_after_preemption):
        adm, adm_new, adm_before = admit_waiting(st, thr, left)
        if adm:
            admitted = len(adm)
            arr = np.asarray(adm, dtype=np.int64)
            st.run = np.concatenate((st.run, arr))
            idx = np.concatenate((idx, arr))
            new = np.concatenate((new, np.asarray(adm_new, dtype=np.int64)))
            before = np.concatenate((before, np.asarray(adm_before, dtype=np.int64)))
    return Scheduled(idx, new, before, admitted, preempted)


def chunk_threshold(st: SchedulerState) -> int:
    """This step's cap on a prefill chunk (0: none): ``long_prefill_token_threshold`` when more than one
    request is running or waiting, capped by the plugin's admission reserve when it is on."""
    s = st.settings
    eligible = len(st.run) + len(st.queue)
    if eligible <= 1:
        return 0
    thr = s.long_prefill_token_threshold
    if s.admission_reserve > 0:
        run, ntok = st.run, st.ntok
        cap = admission_cap(
            s.max_num_batched_tokens,
            float(s.admission_reserve),
            st.free * st.bs,
            s.max_num_seqs - len(run),
            ntok[run] - st.comp[run],
            st.chunking[run],
            (int(ntok[i]) for i in st.queue),
        )
        if cap is not None:
            thr = min(cap, thr) if thr else cap
    return thr


def running_vector(st: SchedulerState, thr: int, budget: int) -> Schedule | None:
    """The running pass when no allocation fails (None when one would: use :func:`running_exact`)."""
    run = st.run
    comp = st.comp[run]
    need = st.ntok[run] - comp
    tok = np.minimum(need, thr) if thr > 0 else need
    cum = np.cumsum(tok)
    total = int(cum[-1])
    if total <= budget:
        new, left = tok, budget - total
    else:
        new = np.minimum(tok, np.maximum(budget - (cum - tok), 0))
        left = 0
    bs = st.bs
    grow = int(((comp + new + bs - 1) // bs - (comp + bs - 1) // bs).sum())
    if grow > st.total_blocks - st.used:
        return None
    st.used += grow
    if left == 0:
        keep = new > 0
        return run[keep], new[keep], comp[keep], 0
    return run, new, comp, left


def running_exact(st: SchedulerState, thr: int, budget: int, preempted: list[tuple[int, int]]) -> Schedule:
    """The running pass, preemptions included (each appended to ``preempted``)."""
    run: list[int] = st.run.tolist()
    comp = dict(zip(run, st.comp[st.run].tolist(), strict=True))
    ntok = dict(zip(run, st.ntok[st.run].tolist(), strict=True))
    policy = st.settings.policy
    bs = st.bs
    sched: dict[int, int] = {}  # request -> new tokens, in scheduling order
    k = 0
    while k < len(run) and budget > 0:
        i = run[k]
        c = comp[i]
        new = ntok[i] - c
        if 0 < thr < new:
            new = thr
        new = min(new, budget)
        grow = -(-(c + new) // bs) + (-c // bs)  # ceil((c + new) / bs) - ceil(c / bs)
        fits = True
        while grow > st.total_blocks - st.used:
            pos = choose_victim(st, run, k, policy)
            victim = run.pop(pos)
            if pos < k:
                k -= 1
            held = comp[victim]
            if victim in sched:  # priority: one scheduled earlier this step gives its tokens back
                restored = sched.pop(victim)
                budget += restored
                held += restored
            st.preempt(victim, held)
            preempted.append((victim, held))
            if victim == i:
                fits = False
                break
        if not fits:
            break
        st.used += grow
        sched[i] = new
        budget -= new
        k += 1
    st.run = np.asarray(run, dtype=np.int64)
    idx = np.fromiter(sched.keys(), dtype=np.int64, count=len(sched))
    new_arr = np.fromiter(sched.values(), dtype=np.int64, count=len(sched))
    before = np.fromiter((comp[i] for i in sched), dtype=np.int64, count=len(sched))
    return idx, new_arr, before, budget


def choose_victim(st: SchedulerState, run: list[int], k: int, policy: str) -> int:
    """Position in ``run`` of the request vLLM preempts while allocating ``run[k]``."""
    if policy == "priority":
        prio, arrival = st.priority, st.arrival
        best, best_key = 0, (int(prio[run[0]]), float(arrival[run[0]]))
        for pos in range(1, len(run)):
            key = (int(prio[run[pos]]), float(arrival[run[pos]]))
            if key > best_key:  # max() keeps the first of the largest
                best, best_key = pos, key
        return best
    if policy == "kv-idle" and k + 1 < len(run):
        # the plugin's _cl_choose_victim: among those not yet scheduled this step, the one idle
        # longest; walked from the end with a strict "<", so ties go to the later request
        last = st.last_active
        best, best_t = len(run) - 1, float("inf")
        for pos in range(len(run) - 1, k, -1):
            t = float(last[run[pos]])
            if t < best_t:
                best, best_t = pos, t
        return best
    if policy == "fcfs" and st.departures.victim_newest_arrival:
        # the newest arrival among those not yet scheduled this step (the first of equals), else itself
        arrivals = st.arrival_list
        newest, newest_t = k, -float("inf")
        for pos in range(k + 1, len(run)):
            t = arrivals[run[pos]]
            if t > newest_t:
                newest, newest_t = pos, t
        return newest
    return len(run) - 1


def advance(
    st: SchedulerState, idx: np.ndarray, new: np.ndarray, before: np.ndarray, mark: float
) -> np.ndarray:
    """The scheduled step ran: each of ``idx`` computed its ``new`` tokens after ``before``. Those whose
    computed tokens reach their sequence's end sample a token (a partial prefill samples none): which
    of ``idx`` did is returned, and their sequences are a token longer. ``mark`` (the step's start in
    the caller's order) is kept as each one's last step, for the ``"kv-idle"`` victim."""
    after = before + new
    st.comp[idx] = after
    ntok = st.ntok[idx]
    emits = after >= ntok
    st.chunking[idx] = ~emits
    if st.settings.policy == "kv-idle":
        st.last_active[idx] = mark
    st.ntok[idx] = ntok + emits
    return emits


def admit_waiting(st: SchedulerState, thr: int, budget: int) -> tuple[list[int], list[int], list[int]]:
    """The waiting pass: (admitted requests, their new tokens, their computed tokens before)."""
    s = st.settings
    queue = st.queue
    bs = st.bs
    n_run = len(st.run)
    admitted: list[int] = []
    new_tokens: list[int] = []
    before: list[int] = []
    while budget > 0 and len(queue) and n_run < s.max_num_seqs:
        i = queue.head()
        c = int(st.cached[i])
        ntok = int(st.ntok[i])
        new = ntok - c
        if 0 < thr < new:
            new = thr
        if not s.enable_chunked_prefill and new > budget:
            break
        new = min(new, budget)
        free = st.total_blocks - st.used
        if s.reserve_full_isl and -(-ntok // bs) > free:
            break
        grow = -(-(c + new) // bs)
        if grow > free:
            break
        queue.pop()
        st.used += grow
        st.comp[i] = c
        admitted.append(i)
        new_tokens.append(new)
        before.append(c)
        budget -= new
        n_run += 1
    return admitted, new_tokens, before


__all__ = [
    "Schedule",
    "Scheduled",
    "admit_waiting",
    "advance",
    "choose_victim",
    "chunk_threshold",
    "running_exact",
    "running_vector",
    "schedule",
]
