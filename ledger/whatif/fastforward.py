"""Fast-forward over decode-only stretches: many identical steps in one go, with the same outcome.

When every running request is decoding (one token, its prompt done), all of them fit the budget,
the waiting queue cannot admit anybody (empty, no free slot, no budget left after the decodes, or,
with ``reserve_full_isl``, its head's whole sequence does not fit the free KV after the step's
allocations, which only shrink until somebody finishes), then each step until the next event is the
same: every running request gets one token. Only ``kv_usage`` changes, as requests cross block
boundaries. The stretch ends at the first of: a request's last token (that step included), the step
whose allocations would not fit (excluded: the plain step preempts), the first step starting at or
after the next arrival, or (admission reserve) when the waiting queue's order would change by aging.

Block growth is counted by phase: a request with ``c`` computed tokens needs a new block in the j-th
step (from 0) of the stretch iff ``(c + j) % block_size == 0``, so the blocks needed per step repeat
with period ``block_size``. Durations come from one ``step_cost`` call per step (reused while the
shape does not change: while nobody takes a new block), and the times accumulate as in the plain
loop, so the replay's results are the same with or without fast-forward, to the last bit.
"""

from __future__ import annotations

import math

import numpy as np

from ledger.whatif.noise import StepNoise
from ledger.whatif.state import State
from ledger.whatif.types import StepCost, StepShape


def step_seconds(cost: StepCost, shape: StepShape) -> float:
    """``cost(shape)`` as a float, refused unless finite and >= 0."""
    d = float(cost(shape))
    if not (d >= 0.0 and math.isfinite(d)):
        raise ValueError(f"step_cost returned {d!r} for {shape}: a step must last a finite time >= 0")
    return d


def _admission_blocked(st: State, n: int, free_after: int) -> bool:
    """Whether the waiting pass admits nobody in a decode-only step (and in the stretch after)."""
    queue = st.queue
    if not len(queue):
        return True
    s = st.settings
    if n >= s.max_num_seqs or s.max_num_batched_tokens - n <= 0:
        return True
    if s.reserve_full_isl:
        return -(-int(st.ntok[queue.head()]) // st.bs) > free_after
    return False  # a chunk that does not fit now may fit under another cap later: no fast-forward


def fast_forward(st: State, cost: StepCost, noise: StepNoise | None = None) -> bool:
    """Run a decode-only stretch from ``st.now`` (its first step at least, as the plain loop would);
    False (nothing done) when the state does not allow one (see the module docstring). ``noise``:
    step ``k``'s factor and loop time, as the plain loop applies them."""
    s = st.settings
    run = st.run
    n = len(run)
    if n > s.max_num_batched_tokens:
        return False
    comp = st.comp[run]
    if int((st.ntok[run] - comp).max()) != 1 or np.count_nonzero(comp < st.prompt[run]):
        return False
    steps = int((st.out[run] - st.gen[run]).min())  # the stretch ends with somebody's last token
    if steps < 2:
        return False
    bs = st.bs
    per_phase = np.bincount((-comp) % bs, minlength=bs).tolist()  # new blocks in step j: [j % bs]
    total = st.total_blocks
    free = total - st.used
    if per_phase[0] > free or not _admission_blocked(st, n, free - per_phase[0]):
        return False

    # the first step: a request that did not run in the previous one has a longer gap
    t = st.now
    used = st.used + per_phase[0]
    shape_d = step_seconds(cost, StepShape(0, 0, 0, 0, n, used / total))  # reused while unchanged
    k0 = st.steps
    if noise is None:
        end = t + shape_d
    else:
        factor, gap = noise.decode(k0)
        loop = noise.loop(gap, st.last_first) if t == st.last_end else 0.0
        end = t + (shape_d * factor + loop)
    gaps, weights = st.gaps, st.gap_weights
    last = st.last_tok[run]
    cont = last == t
    n_cont = int(np.count_nonzero(cont))
    if n_cont:
        gaps.append(end - t)
        weights.append(n_cont)
    if n_cont < n:
        other = (end - last[~cont]).tolist()
        gaps.extend(other)
        weights.extend([1] * len(other))
    start, t, done = t, end, 1

    # the others: every running request decoded in the step before
    queue = st.queue
    waiting = len(queue) > 0
    next_arrival = st.next_arrival_s()
    for j in range(1, steps):
        grow = per_phase[j % bs]
        if t >= next_arrival or (waiting and queue.would_change(t)) or used + grow > total:
            break
        if grow:
            used += grow
            shape_d = step_seconds(cost, StepShape(0, 0, 0, 0, n, used / total))
        if noise is None:
            end = t + shape_d
        else:
            factor, gap = noise.decode(k0 + j)
            end = t + (shape_d * factor + gap)
        gaps.append(end - t)
        weights.append(n)
        start, t = t, end
        done += 1
    st.used = used
    _apply_stretch(st, run, done, start, t)
    return True


def _apply_stretch(st: State, run: np.ndarray, done: int, start: float, end: float) -> None:
    """``done`` decode steps of every running request, the last from ``start`` to ``end``: a token each
    per step; those that reach their output finish at ``end``."""
    st.comp[run] += done
    gen = st.gen[run] + done
    st.gen[run] = gen
    st.ntok[run] += done
    st.chunking[run] = False
    st.last_tok[run] = end
    if st.settings.policy == "kv-idle":
        st.last_active[run] = start
    st.steps += done
    st.now = st.last_end = end
    st.last_first = 0  # decode-only steps emit no first token
    finished = gen >= st.out[run]
    if np.count_nonzero(finished):
        fin = run[finished]
        st.finish[fin] = end
        st.release(fin)


__all__ = ["fast_forward", "step_seconds"]
