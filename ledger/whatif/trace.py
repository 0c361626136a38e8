"""Reading a window of the ledger as a what-if trace: each engine's recorded requests, what was measured,
and what the data says about the engine's settings.

The replay models an engine's scheduler, so a request's arrival is when it reached the engine: its
front end's arrival (``engine_arrival_ts``, vLLM's ``arrival_time``) when the ledger has it and it is
not after ``queued_ts``, else ``queued_ts``; its latencies are the engine's, from that arrival: TTFT =
``first_token_ts - arrival``, end to end = ``finished_ts - arrival`` (the gateway is outside the model).
Not ``queued_ts`` alone: vLLM's engine core adds the requests that came during a step to its scheduler
only after the step, so ``queued_ts`` has already waited for the step in flight, a wait the replay
models (a request that arrives during a step is seen at the next one) and the candidates change: under
a setting with 1-second steps a short prompt's TTFT from ``queued_ts`` hides up to a second of it.
Requests are taken by ``queued_ts`` in [since, until) and must have finished with at least one token;
the others are counted in ``skipped``. Requests still running when the window opens are not in it: the
replay starts from an idle engine.

The measured decode ITL is the ledger's (:func:`ledger.analytics.itl.decode_itl`: step intervals, one
sample per decoding request, in its 0.5 % bins) over the same window and engines, the same quantity the
replay reports.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import sqlalchemy as sa

from ledger import schema
from ledger.analytics.answers import ModelTails
from ledger.analytics.itl import decode_itl
from ledger.analytics.window import Window
from ledger.whatif.answer import Observed
from ledger.whatif.results import ReplaySummary, summarise
from ledger.whatif.types import TraceRequest


@dataclass(frozen=True)
class Recorded:
    """One model's window: the requests per engine source, the measured tails and the skipped counts."""

    model: str | None
    since: float | None
    until: float | None
    requests: dict[str, list[TraceRequest]]  # engine source id -> its requests in arrival order
    ttft_s: np.ndarray  # measured, all engines, same order as the requests concatenated
    e2e_s: np.ndarray
    prompt_tokens: np.ndarray
    preemptions: int
    itl: ModelTails | None  # decode_itl's answer for the model
    observed: Observed
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.requests.values())

    def summary(self, long_prompt_tokens: int | None) -> ReplaySummary:
        """The measured tails, as :meth:`ledger.whatif.results.Replay.summary` gives a replay's (no
        ``steps`` or ``simulated_s``)."""
        return summarise(
            self.ttft_s,
            self.prompt_tokens,
            self.e2e_s,
            long_prompt_tokens,
            itl_p99_s=None if self.itl is None else self.itl.p99,
            preemptions=self.preemptions,
            requests=self.count,
        )


def _cached(cached: int | None, prompt: int) -> int:
    """The recorded prefix hit, below the prompt (the replay rounds it down to its block size)."""
    return min(max(0, int(cached or 0)), prompt - 1)


def arrival_of(queued_ts: float, engine_arrival_ts: float | None) -> float:
    """When the request reached the engine (the module docstring says why not ``queued_ts`` alone)."""
    if engine_arrival_ts is None or engine_arrival_ts > queued_ts:
        return queued_ts
    return float(engine_arrival_ts)


def read_recorded(
    conn: sa.Connection, *, model: str | None, source_ids: list[str], since: float | None, until: float | None
) -> Recorded:
    """The window's finished requests of ``source_ids`` (engines of ``model``) and its measured tails."""
    r = schema.requests
    q = sa.select(
        r.c.request_id,
        r.c.engine_source_id,
        r.c.queued_ts,
        r.c.engine_arrival_ts,
        r.c.first_token_ts,
        r.c.finished_ts,
        r.c.prompt_tokens,
        r.c.cached_tokens,
        r.c.output_tokens,
        r.c.preemptions,
    ).where(r.c.engine_source_id.in_(source_ids), r.c.queued_ts.is_not(None))
    if since is not None:
        q = q.where(r.c.queued_ts >= since)
    if until is not None:
        q = q.where(r.c.queued_ts < until)
    skipped: dict[str, int] = defaultdict(int)
    per_source: dict[str, list[tuple[TraceRequest, float, float]]] = defaultdict(list)
    preemptions = 0
    t0: float | None = None
    for row in conn.execute(q.order_by(r.c.queued_ts, r.c.request_id)):
        if row.finished_ts is None:
            skipped["unfinished"] += 1
            continue
        if not row.output_tokens or row.first_token_ts is None:
            skipped["no_output_token"] += 1
            continue
        if not row.prompt_tokens:
            skipped["no_prompt_length"] += 1
            continue
        t0 = float(row.queued_ts) if t0 is None else t0
        arrival = arrival_of(float(row.queued_ts), row.engine_arrival_ts)
        prompt = int(row.prompt_tokens)
        req = TraceRequest(
            request_id=row.request_id,
            arrival_s=arrival - t0,
            prompt_tokens=prompt,
            cached_tokens=_cached(row.cached_tokens, prompt),
            output_tokens=int(row.output_tokens),
        )
        ttft = max(0.0, float(row.first_token_ts) - arrival)
        e2e = max(0.0, float(row.finished_ts) - arrival)
        per_source[row.engine_source_id].append((req, ttft, e2e))
        preemptions += int(row.preemptions or 0)
    # the measured arrays in the order the replay's results are pooled: source by source
    flat = [x for sid in sorted(per_source) for x in per_source[sid]]
    return Recorded(
        model=model,
        since=since,
        until=until,
        requests={sid: [x[0] for x in per_source[sid]] for sid in sorted(per_source)},
        ttft_s=np.array([x[1] for x in flat], dtype=np.float64),
        e2e_s=np.array([x[2] for x in flat], dtype=np.float64),
        prompt_tokens=np.array([x[0].prompt_tokens for x in flat], dtype=np.int64),
        preemptions=preemptions,
        itl=_measured_itl(conn, source_ids, since, until),
        observed=observe(conn, source_ids, since, until),
        skipped=dict(skipped),
    )


def _measured_itl(
    conn: sa.Connection, source_ids: list[str], since: float | None, until: float | None
) -> ModelTails | None:
    """The ledger's decode ITL tails over the steps of ``source_ids`` only: the replay's engines (all
    the engines of the model would compare a window narrowed to one engine with the others' ITL)."""
    tails = decode_itl(conn, Window(since=since, until=until), source_ids=source_ids)
    return tails[0] if tails else None


def observe(conn: sa.Connection, source_ids: list[str], since: float | None, until: float | None) -> Observed:
    """The settings' traces in the window's steps (:class:`Observed`)."""
    st = schema.steps
    one_chunk = sa.case((st.c.num_prefill_reqs == 1, st.c.prefill_tokens), else_=0)
    q = sa.select(
        sa.func.max(st.c.prefill_tokens + st.c.decode_tokens),
        sa.func.max(st.c.running),
        sa.func.max(st.c.kv_usage),
        sa.func.max(one_chunk),
        sa.func.count(),
    ).where(st.c.source_id.in_(source_ids))
    if since is not None:
        q = q.where(st.c.ts >= since)
    if until is not None:
        q = q.where(st.c.ts < until)
    tokens, running, kv, chunk, n = conn.execute(q).one()
    return Observed(
        max_step_tokens=int(tokens or 0),
        max_running=int(running or 0),
        max_kv_usage=float(kv or 0.0),
        max_chunk_tokens=int(chunk or 0),
        steps=int(n or 0),
    )
