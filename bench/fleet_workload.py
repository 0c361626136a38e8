"""A GPU-shaped engine's event stream, for the ingest benchmark (``bench.ingest --workload fleet-*``).

One engine of a GPU fleet: 256 running requests, a step every 30 ms (33 steps/s), a token budget of
8,192 per step, prompts and outputs drawn log-normal (median 800 and 250 tokens, capped at 8k and 2k),
30 % prefix-cache hits, and one preemption (and its resume) every 100 steps. Every running request
decodes one token per step; a prompt is prefilled in chunks from the budget's remainder, its last chunk
sampling its first token. Output token ids are drawn Zipf-like over a 32k vocabulary (text, not
loops), so the loop detector works as it would on real output.

The same stream is written two ways:

* ``steps``: the output tokens ride on the step event (``token_counts``, ``token_totals``,
  ``token_ids``; schema 2), lifecycle events per request (queued, chunk, preempted, resumed,
  finished): what the vLLM plugin sends by default;
* ``tokens``: the same steps without token columns, and a ``tokens`` event per request every 16 tokens
  (and at its end): what it sent before (``step_tokens`` off).

Batches are encoded once into templates: ``seq`` values are ``%d`` slots and request ids carry the
placeholder ``@@``, replaced per source and per pass over the cycle, so a client spends its CPU on
sending, not on building events.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine_hooks import events as ev
from ledger.rules.policy import LoopSettings

RUNNING = 256
STEP_S = 0.03
BUDGET = 8192
FLUSH = 16  # tokens per tokens event in the "tokens" form (the plugin's tokens_flush)
PREEMPT_EVERY = 100  # steps
_VOCAB = 32_000
# With ``loops``: every LOOP_EVERY-th request falls into a loop after LOOP_AFTER output tokens, a block
# of LOOP_BLOCK tokens repeated to its end; the default policy cuts it once the loop spans LOOP_SPAN.
LOOP_EVERY = 50
LOOP_AFTER = 32
LOOP_BLOCK = 12
_L = LoopSettings()
LOOP_SPAN = max(_L.min_span_tokens, _L.min_repeats * LOOP_BLOCK + _L.confirm_tokens)


@dataclass
class _Req:
    n: int
    prompt: int
    output: int
    cached: int
    computed: int = 0
    out: int = 0
    chunks: int = 0
    looped: int = 0  # loop tokens in the kept steps
    pending: list[int] = field(default_factory=list)


def _lognormal(rnd: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(math.exp(rnd.gauss(math.log(median), sigma)))))


@dataclass
class Cycle:
    """Batch templates for one pass over the stream, and what they hold."""

    batches: list[str]  # %-templates over the batch's seqs; "@@" stands for the request id prefix
    events: list[int]  # events per batch
    tokens: list[int]  # output tokens per batch
    steps: int
    loops: list[int] = field(default_factory=list)  # per batch: loops that reach the policy's span in it


def build_cycle(
    form: str, *, steps: int, steps_per_batch: int, seed: int = 0, warmup: int = 400, loops: bool = False
) -> Cycle:
    """``steps`` engine steps as batches of ``steps_per_batch`` steps with their lifecycle events, after
    ``warmup`` steps that are not kept (the start, where all 256 requests prefill at once); ``loops``:
    one request in ``LOOP_EVERY`` loops (``Cycle.loops`` counts them per batch)."""
    if form not in ("steps", "tokens"):
        raise ValueError(f"form must be 'steps' or 'tokens', not {form!r}")
    rnd = random.Random(seed)
    weights = [1.0 / (rank + 10) for rank in range(_VOCAB)]
    vocab = list(range(_VOCAB))
    draws: list[int] = []
    src = ev.Source(id="@SRC@", kind="engine", model="fleet")
    running: list[_Req] = []
    preempted: list[_Req] = []
    counter = 0
    t0 = 1.7e9
    batches, n_events, n_tokens, loops_in = [], [], [], []
    pending: list[Any] = []
    tokens_in_batch = 0
    n_loops = 0

    def rid(r: _Req) -> str:
        return f"@@-{r.n:07d}-{r.n * 2654435761 % 2**32:08x}"  # vLLM-like length

    def new_request(ts: float) -> _Req:
        nonlocal counter
        counter += 1
        prompt = _lognormal(rnd, 800, 1.0, 8192)
        cached = (prompt // 2) // 16 * 16 if rnd.random() < 0.3 else 0
        r = _Req(counter, prompt, _lognormal(rnd, 250, 0.9, 2048), cached, computed=cached)
        pending.append(ev.Queued(seq=0, ts=ts, request_id=rid(r), prompt_tokens=prompt, max_tokens=2048))
        return r

    for k in range(warmup + steps):
        ts = t0 + k * STEP_S
        end = ts + STEP_S * 0.9
        while len(running) + len(preempted) < RUNNING:
            running.append(new_request(ts))
        if preempted and k % PREEMPT_EVERY == PREEMPT_EVERY // 2:
            r = preempted.pop()
            pending.append(ev.Resumed(seq=0, ts=ts, request_id=rid(r), wait_s=1.5, output_tokens=r.out))
            r.computed = 0
            running.append(r)
        if k % PREEMPT_EVERY == 0 and k:
            r = running.pop()
            pending.append(ev.Preempted(seq=0, ts=ts, request_id=rid(r), kv_blocks_freed=40))
            preempted.append(r)
        budget = BUDGET
        ids: list[str] = []
        counts: list[int] = []
        totals: list[int] = []
        new_ids: list[int] = []
        prefill = depth = max_depth = n_prefill = 0
        finished: list[_Req] = []
        for r in running:
            held = r.prompt + max(r.out - 1, 0)
            if r.computed < held:  # prefill (first pass or recompute)
                n = min(held - r.computed, max(budget - (RUNNING - len(ids)), 0))
                if n <= 0:
                    continue
                pending.append(
                    ev.Chunk(
                        seq=0,
                        ts=ts,
                        request_id=rid(r),
                        step=k,
                        tokens=n,
                        computed_before=r.computed,
                        cached_tokens=r.cached if r.chunks == 0 else 0,
                        kv_blocks=(r.computed + n) // 16 + 1,
                        wait_s=0.2 if r.chunks == 0 else None,
                    )
                )
                r.chunks += 1
                prefill += n
                depth += n * r.computed
                max_depth = max(max_depth, r.computed)
                n_prefill += 1
                r.computed += n
                budget -= n
                sampled = r.computed >= held
            else:
                budget -= 1
                r.computed += 1
                sampled = True
            ids.append(rid(r))
            if sampled:
                if not draws:
                    draws = rnd.choices(vocab, weights, k=65_536)
                tok = draws.pop()
                if loops and r.n % LOOP_EVERY == 0 and r.out >= LOOP_AFTER:
                    tok = _VOCAB + (r.out - LOOP_AFTER) % LOOP_BLOCK  # ids no text draw gives
                    if k >= warmup:
                        r.looped += 1
                        if r.looped == LOOP_SPAN:  # of the kept stream: the ledger sees no other
                            n_loops += 1
                r.out += 1
                counts.append(1)
                new_ids.append(tok)
                if form == "tokens":
                    r.pending.append(tok)
            else:
                counts.append(0)
            totals.append(r.out)
            if sampled and (form == "tokens") and (len(r.pending) >= FLUSH or r.out >= r.output):
                pending.append(
                    ev.Tokens(
                        seq=0,
                        ts=end,
                        request_id=rid(r),
                        count=len(r.pending),
                        total=r.out,
                        first_ts=end - STEP_S * (len(r.pending) - 1),
                        token_ids=r.pending,
                    )
                )
            if form == "tokens" and len(r.pending) >= FLUSH:
                r.pending = []
            if r.out >= r.output:
                finished.append(r)
        step = ev.Step(
            seq=0,
            ts=ts,
            step=k,
            duration_s=STEP_S * 0.9,
            prefill_tokens=prefill,
            decode_tokens=len(ids) - n_prefill,
            num_prefill_reqs=n_prefill,
            num_decode_reqs=len(ids) - n_prefill,
            running=len(running),
            waiting=len(preempted),
            kv_usage=0.8,
            request_ids=ids,
            prefill_depth_tokens=depth,
            max_prefill_depth=max_depth,
            token_counts=counts if form == "steps" else [],
            token_totals=totals if form == "steps" else [],
            token_ids=new_ids if form == "steps" else [],
        )
        pending.append(step)
        tokens_in_batch += sum(counts)
        for r in finished:
            running.remove(r)
            pending.append(ev.Finished(seq=0, ts=end, request_id=rid(r), reason="stop", output_tokens=r.out))
        if k < warmup:
            pending, tokens_in_batch = [], 0
        elif (k + 1 - warmup) % steps_per_batch == 0:
            batches.append(_template(src, pending, schema_version=2 if form == "steps" else 1))
            n_events.append(len(pending))
            n_tokens.append(tokens_in_batch)
            loops_in.append(n_loops)
            pending, tokens_in_batch, n_loops = [], 0, 0
    return Cycle(batches, n_events, n_tokens, steps, loops_in)


def _template(src: ev.Source, events: list[Any], schema_version: int) -> str:
    """``schema_version``: 1 for the tokens form, which uses nothing newer, so that a ledger from
    before version 2 takes it too (``bench.ingest``'s before/after runs)."""
    numbered = [msgspec.structs.replace(e, seq=900_000_000_000 + i) for i, e in enumerate(events)]
    batch = ev.Batch(source=src, events=numbered, schema_version=schema_version)
    raw = ev.batch_encoder.encode(batch).decode().replace("%", "%%")
    return re.sub(r'"seq":9000\d{8}', '"seq":%d', raw)


def render(tpl: str, source_id: str, prefix: str, first_seq: int, n_events: int) -> bytes:
    """One batch of the cycle for ``source_id``, its request ids prefixed ``prefix`` (one per pass over
    the cycle, so each pass brings new requests), seqs from ``first_seq``."""
    body = tpl % tuple(range(first_seq, first_seq + n_events))
    return body.replace("@SRC@", source_id).replace("@@", prefix).encode()
