"""Inter-token latency: tails over a window from the steps (``decode_itl``), and one request's gaps
rebuilt from the steps it took part in (``request_itl``)."""

from __future__ import annotations

import itertools
from typing import Any

import sqlalchemy as sa

from ledger import schema
from ledger.analytics.answers import ModelTails, RequestItl
from ledger.analytics.common import (
    QUANTILES,
    S,
    event_data,
    in_window,
    percentile,
    ran_in_step,
    request_row,
    started_by,
)
from ledger.analytics.window import Window
from ledger.records import UNSET

# Weighted quantiles of the step intervals come from a log-binned histogram: bins 0.5 % wide, each
# reported by its largest member, so a quantile is over by at most 0.5 % and the query never sorts
# millions of steps (tails of 1.4M steps in ~50 ms on DuckDB; see bench/analytics.py).
_ITL_BINS_PER_E = 200


def decode_itl(
    conn: sa.Connection,
    window: Window = Window(),
    *,
    group_by_model: bool = False,
    source_ids: list[str] | None = None,
) -> list[ModelTails]:
    """Inter-token latency tails of decoding requests, from ``steps`` (per model with ``group_by_model``).

    A request that decodes in two consecutive steps of its engine sees ``steps.interval_s`` between its
    tokens (end of the previous step to end of this one); each step counts once per decoding request
    in it, so the tails are per token. Requests that sat steps out (``stalled_request_ids``) saw longer
    gaps than this; their exact gaps are in ``request_itl``. ``source_ids``: those engines' steps only.
    """
    src = schema.sources
    gap = S.c.interval_s
    key = sa.func.round(sa.func.ln(sa.func.greatest(gap, 1e-9)) * _ITL_BINS_PER_E).label("k")
    sums = [
        sa.func.sum(S.c.num_decode_reqs).label("w"),
        sa.func.sum(gap * S.c.num_decode_reqs).label("gw"),
        sa.func.max(gap).label("top"),
    ]
    # By model, the steps join their sources; else they are binned alone: grouping 14M steps by their
    # source as well took 0.5 of the 0.75 s over an hour of 236 engines.
    if group_by_model:
        model = sa.func.coalesce(src.c.model, "").label("model")
        stmt = (
            sa.select(model, key, *sums)
            .select_from(S.outerjoin(src, src.c.source_id == S.c.source_id))
            .group_by(model, key)
        )
    else:
        stmt = sa.select(sa.literal("").label("model"), key, *sums).group_by(key)
    stmt = stmt.where(gap.is_not(None), S.c.num_decode_reqs > 0)
    if source_ids is not None:
        stmt = stmt.where(S.c.source_id.in_(source_ids))
    bins = in_window(stmt, window, S.c.ts).subquery()
    part = [bins.c.model] if group_by_model else []
    cum = sa.func.sum(bins.c.w).over(partition_by=part or None, order_by=bins.c.k)
    tot = sa.func.sum(bins.c.w).over(partition_by=part or None)
    ranked = sa.select(bins.c.model, bins.c.top, bins.c.w, bins.c.gw, (cum / tot).label("cdf")).subquery()
    cols: list[sa.ColumnElement[Any]] = [
        sa.func.sum(ranked.c.w).label("n"),
        *(sa.func.min(sa.case((ranked.c.cdf >= q, ranked.c.top))).label(k) for k, q in QUANTILES.items()),
        sa.func.max(ranked.c.top).label("max"),
        # the mean (shown only beside the tails), exact: summed per bin, not read off the bins
        (sa.func.sum(ranked.c.gw) / sa.func.sum(ranked.c.w)).label("mean"),
    ]
    out_stmt = sa.select(*([ranked.c.model] if group_by_model else []), *cols)
    if group_by_model:
        out_stmt = out_stmt.group_by(ranked.c.model).order_by(ranked.c.model)
    return [
        ModelTails(
            n=int(row["n"]),
            **{k: row[k] for k in QUANTILES},
            max=row["max"],
            mean=row["mean"],
            model=(row["model"] or None) if group_by_model else UNSET,
        )
        for row in conn.execute(out_stmt).mappings()
        if row["n"]
    ]


def _silent_chunk_steps(
    events: list[dict[str, Any]], source_id: str, prompt_tokens: int | None
) -> tuple[set[int], int | None]:
    """Of a request's ``chunk`` events (with its ``resumed`` and ``tokens`` events, in time order): the
    steps whose chunk sampled no token, and the step whose chunk sampled the first token (None: unknown).

    vLLM v1 keeps the token sampled in a step only when the step computed every position the request
    has, its prompt plus the output tokens it holds (a partial prefill's sample is discarded), so a
    chunk yielded a token iff ``computed_before + tokens >= prompt_tokens + output`` where ``output`` is
    the output tokens held when the pass began: 0 on the first pass; after a preemption, the tokens
    delivered before the resume. ``resumed.output_tokens`` counts those held at the preemption; under
    async scheduling the step in flight then is delivered after it (the resume waits for it), so the
    tokens events add what they show delivered before the chunk: a group's whole ``total`` when it was
    sent before the chunk, its first token when ``first_ts`` is before it (the hook flushes at each
    preemption, so that token is the one in flight). Both are lower bounds of ``output``, exact for one
    token in flight (spec decode may have more; then a partial chunk ending within them would count).
    Without the prompt length every chunk step counts as silent (the rule before the resume fix).
    """
    chunks = [e for e in events if e["kind"] == "chunk" and e.get("source_id") == source_id and "step" in e]
    if prompt_tokens is None:
        return {c["step"] for c in chunks}, None
    groups = [
        (e.get("first_ts") or e["ts"], e["ts"], e.get("total", 0), e.get("count", 0))
        for e in events
        if e["kind"] == "tokens" and e.get("source_id") == source_id
    ]
    silent: set[int] = set()
    first_step: int | None = None
    resumed_with = 0
    for e in events:
        if e.get("source_id") != source_id:
            continue
        if e["kind"] == "resumed":
            resumed_with = max(resumed_with, e.get("output_tokens", 0))
            continue
        if e["kind"] != "chunk" or "step" not in e:
            continue
        ts = e["ts"]
        held = resumed_with
        for first_ts, sent_ts, total, count in groups:
            if sent_ts < ts:
                held = max(held, total)
            elif first_ts < ts:
                held = max(held, total - count + min(count, 1))
        if e.get("computed_before", 0) + e.get("tokens", 0) >= prompt_tokens + held:
            if first_step is None or e["step"] < first_step:
                first_step = e["step"]
        else:
            silent.add(e["step"])
    return silent, first_step


def request_itl(conn: sa.Connection, request_id: str) -> RequestItl | None:
    """One request's inter-token gaps: its first token, then the end of every later step in which it
    sampled a token: every step it decoded in, and a step whose chunk completed a recompute after a
    preemption (``_silent_chunk_steps``); a chunk that left the prefill partial yields no token.

    None for an unknown request; ``n`` 0 when it has fewer than two tokens or no step rows."""
    row = request_row(conn, request_id)
    if row is None:
        return None
    empty = RequestItl(n=0, p50=None, p90=None, p99=None, max=None, mean=None, gaps=[])
    first, src = row.first_token_ts, row.engine_source_id
    if first is None or src is None:
        return empty
    last = row.last_step_ts or row.last_token_ts or first
    silent, first_step = _silent_chunk_steps(
        event_data(conn, request_id, ["chunk", "resumed", "tokens"]), src, row.prompt_tokens
    )
    # Every step it ran starts at or after its first scheduling (as ``why`` reads them); a range on ts
    # itself, so that DuckDB's zone maps skip the rest of the table.
    lo = row.first_scheduled_ts - 1e-9 if row.first_scheduled_ts is not None else started_by(conn, src, first)
    steps = conn.execute(
        sa.select(S.c.step, (S.c.ts + S.c.duration_s).label("end"))
        .where(
            S.c.source_id == src,
            S.c.ts >= min(lo, first),
            S.c.ts + S.c.duration_s > first + 1e-6,
            S.c.ts <= last,
            ran_in_step(request_id),
        )
        .order_by(S.c.step)
    ).all()
    # The first token's own step is ``first``: a later step end only (its end may sit a clock tick past).
    after = -1 if first_step is None else first_step
    ends = [first] + [end for step, end in steps if step > after and step not in silent]
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    if not gaps:
        return empty
    xs = sorted(gaps)
    return RequestItl(
        n=len(gaps),
        **{k: percentile(xs, q) for k, q in QUANTILES.items()},
        max=xs[-1],
        mean=sum(xs) / len(xs),
        gaps=gaps,
    )
