"""The what-if replay: recorded requests through a model of vLLM v1's scheduler, step by step.

:func:`replay` feeds each request in at its recorded arrival with its recorded prompt length,
prefix-cache hit and output length, schedules steps with the model of vLLM 0.32's
``Scheduler.schedule()`` that the fleet simulator shares (:mod:`engine_hooks.scheduling.schedule`)
under the :class:`~engine_hooks.scheduling.settings.EngineSettings` to try, and times each step with
the caller's step-cost model. A step starts when the previous one ends, or at
the next arrival when nothing can run; requests that arrive during a step are seen at the next.

Per step, with the step's chunk threshold (vLLM's ``long_prefill_token_threshold``, ignored when a
single request is running or waiting; with the plugin's admission reserve, capped further by
:func:`engine_hooks.scheduling.reserve.admission_cap`): the running pass, then, if it preempted nobody, the
waiting pass. A request whose prompt (or, after a preemption, its recomputation) completes in the
step emits a token at the end of the step: its first token (TTFT = that time - arrival), or the next
one of a resumed request. Every decode emits one token per step it runs in. A request finishes with
its ``output_tokens``-th token and frees its KV. A preempted request frees its KV, keeps the tokens
it produced, and on resume recomputes prompt and output beyond its recorded prefix-cache hit.

What the model assumes, and where it differs from vLLM:

* synchronous scheduling (one step at a time, as vLLM without async scheduling), no pipeline
  parallelism, no speculative decoding (a decode is one token), no KV connector, no multimodal
  inputs, no LoRA limits, no ``max_model_len`` checks beyond refusing impossible requests;
* the prefix cache only as the recorded hit, at the first schedule and at every resume (vLLM looks
  the cache up again on resume and often finds the request's own freed blocks there: the model is
  pessimistic about recomputation); a hit's blocks count as the request's own (never shared);
* vLLM 0.32's defaults: ``scheduler_reserve_full_isl`` on (a setting), no watermark, the adaptive
  long-prefill threshold off, ``max_num_scheduled_tokens`` = ``max_num_batched_tokens``;
* a step that schedules nothing (it only preempted) takes no time; the next one starts at once; a
  step's duration is all ``step_cost`` says, and with step noise, the window's spread and the engine
  loop's time between steps as the window measured them (:mod:`ledger.whatif.noise`);
* the plugin's admission reserve without its depth cap, step target or arrivals-first options, and
  its queue order with ties between equal arrival times broken by trace order; ``"kv-idle"``
  preempts as FCFS does in this model (:mod:`engine_hooks.scheduling.schedule` says why);
* outputs never stop early (the recorded output length is produced whatever the schedule), and
  nothing is aborted.

The replay is exact step by step; decode-only stretches are fast-forwarded
(:mod:`ledger.whatif.fastforward`) with the same result. ``step_cost`` must be a pure function of the
shape (the fast-forward calls it once per distinct shape in a row).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from engine_hooks.scheduling.schedule import Scheduled, advance, schedule
from engine_hooks.scheduling.settings import VLLM, Departures, EngineSettings
from ledger.whatif.fastforward import fast_forward as _fast_forward
from ledger.whatif.fastforward import step_seconds
from ledger.whatif.noise import StepNoise
from ledger.whatif.results import Replay
from ledger.whatif.state import State
from ledger.whatif.types import StepCost, StepShape, TraceRequest


class ReplayTimeout(Exception):
    """A replay ran past its deadline."""


def replay(
    requests: Sequence[TraceRequest],
    settings: EngineSettings,
    step_cost: StepCost,
    *,
    noise: StepNoise | None = None,
    fast_forward: bool = True,
    vectorized: bool = True,
    deadline: float | None = None,
    departures: Departures = VLLM,
    observe: Callable[[State, Scheduled], None] | None = None,
) -> Replay:
    """Replay ``requests`` under ``settings``, each step lasting ``step_cost(shape)`` seconds. With
    ``noise`` (:class:`ledger.whatif.noise.StepNoise`), the ``k``-th step (from 0) lasts, if it is
    decode-only, its drawn factor times that (a step with a prefill chunk keeps its fitted time), plus, if
    it follows the previous step directly (the engine was not idle), the engine loop's time before it
    (:meth:`~ledger.whatif.noise.StepNoise.decode`, :meth:`~ledger.whatif.noise.StepNoise.prefill_gap`,
    and ``noise.per_first_token`` for each first token the step before emitted).

    Raises ValueError naming the first request the engine could never run: one whose KV for prompt +
    output - 1 tokens exceeds the KV cache, or, with chunked prefill off, whose prompt (less its
    cached prefix), or recomputation after a preemption, exceeds ``max_num_batched_tokens``: vLLM
    refuses such configurations (``max_model_len`` must fit), and the request would wait for ever.

    ``fast_forward`` (decode-only stretches in one go) and ``vectorized`` (numpy for the running pass
    when no allocation fails) change the speed only, never the result: off, every step is the plain
    loop; the tests compare them.

    ``deadline`` (``time.monotonic()``): past it the replay stops with :class:`ReplayTimeout`.
    ``departures``: schedule as a model that departs from vLLM does (the simulator's,
    :data:`engine_hooks.scheduling.settings.SIMULATOR`). ``observe(state, scheduled)`` is called with
    every ``schedule()``'s outcome, before the step runs (the replay then runs step by step).
    """
    st = State(requests, settings, departures)
    steps = 0
    st.validate()
    queue = st.queue
    fast_forward = fast_forward and observe is None
    while True:
        steps += 1
        if deadline is not None and not steps & 1023 and time.monotonic() > deadline:
            raise ReplayTimeout(f"the replay passed its deadline at t={st.now:.1f} s of the trace")
        st.queue_arrivals()
        n = len(st.run)
        if not n and not len(queue):
            if st.next_arrival >= st.n:
                break
            st.now = st.arrival_list[st.next_arrival]  # idle until the next arrival
            continue
        queue.prepare(st.now)
        if fast_forward and n and _fast_forward(st, step_cost, noise):
            continue
        sched = schedule(st, vectorized)
        if observe is not None:
            observe(st, sched)
        if not len(sched.idx):
            if sched.preempted:
                continue  # nothing ran: the next schedule() comes at once
            raise RuntimeError(f"the replay is stuck at t={st.now}: nothing can run (a bug in the model)")
        _run_step(st, sched.idx, sched.new, sched.before, step_cost, noise)
    return _results(st)


def _run_step(
    st: State,
    idx: np.ndarray,
    new: np.ndarray,
    before: np.ndarray,
    cost: StepCost,
    noise: StepNoise | None,
) -> None:
    """Time the scheduled step and apply its outcome: tokens, first tokens, gaps, finishes."""
    t = st.now
    prefill = (before < st.prompt[idx]) | (new > 1)
    n_prefill = int(np.count_nonzero(prefill))
    usage = st.used / st.total_blocks
    if n_prefill:
        chunk, depth = new[prefill], before[prefill]
        shape = StepShape(
            int(chunk.sum()),
            int((chunk * depth).sum()),
            int(depth.max()),
            n_prefill,
            len(idx) - n_prefill,
            usage,
        )
    else:
        shape = StepShape(0, 0, 0, 0, len(idx), usage)
    d = step_seconds(cost, shape)
    if noise is not None:
        k = st.steps
        loop = t == st.last_end  # the engine went on from the previous step, not from idle
        if n_prefill:
            d += noise.loop(noise.prefill_gap(k), st.last_first) if loop else 0.0
        else:
            factor, gap = noise.decode(k)
            d = d * factor + (noise.loop(gap, st.last_first) if loop else 0.0)
    end = t + d
    st.last_end = end
    st.last_first = 0
    emits = advance(st, idx, new, before, t)
    st.now = end
    st.steps += 1
    if not np.count_nonzero(emits):
        return
    e = idx[emits]
    gen = st.gen[e]
    first = gen == 0
    n_first = int(np.count_nonzero(first))
    if n_first:
        st.first_tok[e[first]] = end
        st.last_first = n_first
    if n_first < len(e):
        last = st.last_tok[e[~first]]
        cont = last == t  # decoded in the previous step too: the gap is this step
        n_cont = int(np.count_nonzero(cont))
        if n_cont:
            st.gaps.append(end - t)
            st.gap_weights.append(n_cont)
        if n_cont < len(last):
            other = (end - last[~cont]).tolist()
            st.gaps.extend(other)
            st.gap_weights.extend([1] * len(other))
    st.last_tok[e] = end
    gen += 1
    st.gen[e] = gen
    done = gen >= st.out[e]
    if np.count_nonzero(done):
        fin = e[done]
        st.finish[fin] = end
        st.release(fin)


def _results(st: State) -> Replay:
    """The outcome, back in the caller's request order."""
    n = st.n
    where = st.order

    def back(values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        out[where] = values
        return out

    ids = [""] * n
    for k, rid in zip(where.tolist(), st.request_id, strict=True):
        ids[k] = rid
    first_arrival = st.arrival_list[0] if n else 0.0
    return Replay(
        request_id=ids,
        prompt_tokens=back(st.prompt),
        ttft_s=back(st.first_tok - st.arrival),
        e2e_s=back(st.finish - st.arrival),
        preemptions=back(st.preempts),
        itl_gap_s=np.asarray(st.gaps, dtype=np.float64),
        itl_count=np.asarray(st.gap_weights, dtype=np.int64),
        steps=st.steps,
        simulated_s=(st.now - first_arrival) if n else 0.0,
    )


__all__ = ["EngineSettings", "Replay", "StepShape", "TraceRequest", "replay"]
