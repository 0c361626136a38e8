"""Named analytics queries, shared by the API, the CLI and the dashboard.

Written once in SQLAlchemy Core and run on DuckDB and PostgreSQL alike (both speak
``percentile_cont(q) WITHIN GROUP (ORDER BY x)`` and ``x = ANY(array)``). Every summary carries the
tails (p50, p90, p99, max) with the count; a mean is only ever shown next to them.

* ``attribution``  per-layer tails over a window, grouped (model, source, finish reason) and optionally
  bucketed over time;
* ``list_requests`` filter, sort by any column of the ``requests`` view, paginate;
* ``decode_itl``   inter-token latency tails over a window, from ``steps``;
* ``request_itl``  one request's inter-token gaps, rebuilt from the steps it took part in;
* ``why``          what delayed one request, biggest first;
* ``kv_stalls``    live requests ranked by how long their KV has sat without a new token.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import msgspec
import sqlalchemy as sa

from ledger import schema
from ledger.analytics.window import Window

R = schema.requests
S = schema.steps
E = schema.events

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
# The latencies summarised per request, in the order a reader follows a request through the system.
METRICS = (
    "entry_s",
    "admission_s",
    "backend_wait_s",
    "frontend_s",
    "engine_queue_s",
    "prefill_s",
    "decode_s",
    "ttft_s",
    "client_ttft_s",
    "delivery_s",
    "e2e_s",
    "kv_idle_s",
)
GROUPS = {
    "model": R.c.model,
    "engine_source_id": R.c.engine_source_id,
    "gateway_source_id": R.c.gateway_source_id,
    "finish_reason": R.c.finish_reason,
}
SORTABLE = frozenset(c.name for c in R.columns)
MAX_PAGE = 1000


class QueryError(ValueError):
    """A query parameter that cannot be honoured; ``field`` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def _tails(col: sa.ColumnElement[Any], name: str) -> list[sa.ColumnElement[Any]]:
    out: list[sa.ColumnElement[Any]] = [
        sa.func.percentile_cont(q).within_group(col).label(f"{name}__{k}") for k, q in QUANTILES.items()
    ]
    out.append(sa.func.max(col).label(f"{name}__max"))
    out.append(sa.func.avg(col).label(f"{name}__mean"))
    out.append(sa.func.count(col).label(f"{name}__n"))
    return out


def _summary(row: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: row[f"{name}__{k}"] for k in ("n", *QUANTILES, "max", "mean")}


def _window(stmt: sa.Select[Any], w: Window, col: sa.ColumnElement[Any]) -> sa.Select[Any]:
    if w.since is not None:
        stmt = stmt.where(col >= w.since)
    if w.until is not None:
        stmt = stmt.where(col < w.until)
    return stmt


def _group_cols(group_by: Sequence[str]) -> list[sa.ColumnElement[Any]]:
    cols: list[sa.ColumnElement[Any]] = []
    for g in group_by:
        if g not in GROUPS:
            raise QueryError("group_by", f"unknown group {g!r}; use any of {', '.join(GROUPS)}")
        cols.append(GROUPS[g].label(g))
    return cols


def attribution(
    conn: sa.Connection,
    window: Window = Window(),
    *,
    group_by: Sequence[str] = (),
    bucket_s: float | None = None,
) -> list[dict[str, Any]]:
    """Finished requests (by end time) in the window: count and tails of every layer, TTFT, e2e.

    One entry per group (and per time bucket when ``bucket_s`` is set, keyed by the bucket start).
    """
    groups = _group_cols(group_by)
    cols: list[sa.ColumnElement[Any]] = [*groups, sa.func.count().label("requests")]
    if bucket_s is not None:
        if not (bucket_s > 0 and math.isfinite(bucket_s)):
            raise QueryError("bucket_s", "must be a positive number of seconds")
        bucket = (sa.func.floor(R.c.end_ts / bucket_s) * bucket_s).label("bucket_ts")
        cols.insert(0, bucket)
        groups = [bucket, *groups]
    for m in METRICS:
        cols += _tails(R.c[m], m)
    cols.append(sa.func.sum(R.c.output_tokens).label("output_tokens"))
    cols.append(sa.func.sum(R.c.preemptions).label("preemptions"))
    stmt = _window(sa.select(*cols).where(R.c.end_ts.is_not(None)), window, R.c.end_ts)
    if groups:
        stmt = stmt.group_by(*groups).order_by(*groups)
    out = []
    for row in conn.execute(stmt).mappings():
        if not row["requests"]:
            continue
        entry: dict[str, Any] = {g: row[g] for g in group_by}
        if bucket_s is not None:
            entry["bucket_ts"] = row["bucket_ts"]
        entry["requests"] = row["requests"]
        entry["output_tokens"] = row["output_tokens"] or 0
        entry["preemptions"] = row["preemptions"] or 0
        entry["layers"] = {m: _summary(dict(row), m) for m in METRICS}
        out.append(entry)
    return out


def list_requests(
    conn: sa.Connection,
    window: Window = Window(),
    *,
    model: str | None = None,
    source_id: str | None = None,
    finish_reason: str | None = None,
    live: bool | None = None,
    min_e2e_s: float | None = None,
    min_ttft_s: float | None = None,
    sort: str = "end_ts",
    descending: bool = True,
    limit: int = 100,
    offset: int = 0,
) -> dict[str, Any]:
    """Rows of the ``requests`` view, filtered, sorted by any column, a page at a time.

    The window applies to the request's start (``start_ts``) so that live requests are listed too.
    """
    if sort not in SORTABLE:
        raise QueryError("sort", f"unknown column {sort!r}; any column of the requests view sorts")
    if not 1 <= limit <= MAX_PAGE:
        raise QueryError("limit", f"must be between 1 and {MAX_PAGE}")
    if offset < 0:
        raise QueryError("offset", "must be >= 0")
    where: list[sa.ColumnElement[bool]] = []
    if model is not None:
        where.append(R.c.model == model)
    if source_id is not None:
        where.append(sa.or_(R.c.engine_source_id == source_id, R.c.gateway_source_id == source_id))
    if finish_reason is not None:
        where.append(R.c.finish_reason == finish_reason)
    if live is not None:
        where.append(R.c.end_ts.is_(None) if live else R.c.end_ts.is_not(None))
    if min_e2e_s is not None:
        where.append(R.c.e2e_s >= min_e2e_s)
    if min_ttft_s is not None:
        where.append(R.c.ttft_s >= min_ttft_s)
    base = _window(sa.select(R).where(*where), window, R.c.start_ts)
    total = conn.execute(sa.select(sa.func.count()).select_from(base.subquery())).scalar_one()
    key = R.c[sort].desc() if descending else R.c[sort].asc()
    nulls = key.nulls_last()
    page = base.order_by(nulls, R.c.request_id).limit(limit).offset(offset)
    rows = [dict(r) for r in conn.execute(page).mappings()]
    return {"total": total, "offset": offset, "limit": limit, "sort": sort, "rows": rows}


# Weighted quantiles of the step intervals come from a log-binned histogram: bins 0.5 % wide, each
# reported by its largest member, so a quantile is over by at most 0.5 % and the query never sorts
# millions of steps (tails of 1.4M steps in ~50 ms on DuckDB; see bench/analytics.py).
_ITL_BINS_PER_E = 200


def decode_itl(
    conn: sa.Connection, window: Window = Window(), *, group_by_model: bool = False
) -> list[dict[str, Any]]:
    """Inter-token latency tails of decoding requests, from ``steps``.

    A request that decodes in two consecutive steps of its engine sees ``steps.interval_s`` between its
    tokens (end of the previous step to end of this one); each step counts once per decoding request
    in it, so the tails are per token. Requests that sat steps out (``stalled_request_ids``) saw longer
    gaps than this; their exact gaps are in ``request_itl``.
    """
    src = schema.sources
    model = sa.func.coalesce(src.c.model, "").label("model")
    gap = S.c.interval_s
    key = sa.func.round(sa.func.ln(sa.func.greatest(gap, 1e-9)) * _ITL_BINS_PER_E).label("k")
    stmt = (
        sa.select(
            model,
            key,
            sa.func.sum(S.c.num_decode_reqs).label("w"),
            sa.func.sum(gap * S.c.num_decode_reqs).label("gw"),
            sa.func.max(gap).label("top"),
        )
        .select_from(S.outerjoin(src, src.c.source_id == S.c.source_id))
        .where(gap.is_not(None), S.c.num_decode_reqs > 0)
        .group_by(model, key)
    )
    bins = _window(stmt, window, S.c.ts).subquery()
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
    out = []
    for row in conn.execute(out_stmt).mappings():
        if not row["n"]:
            continue
        m = row["model"] if group_by_model else None
        entry: dict[str, Any] = {"n": int(row["n"]), **{k: row[k] for k in (*QUANTILES, "max", "mean")}}
        if group_by_model:
            entry = {"model": m or None, **entry}
        out.append(entry)
    return out


def _percentile(sorted_xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (what percentile_cont computes)."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def _request_row(conn: sa.Connection, request_id: str) -> dict[str, Any] | None:
    row = conn.execute(sa.select(R).where(R.c.request_id == request_id)).mappings().first()
    return dict(row) if row is not None else None


def _event_data(conn: sa.Connection, request_id: str, kinds: Sequence[str]) -> list[dict[str, Any]]:
    rows = conn.execute(
        sa.select(E.c.source_id, E.c.ts, E.c.kind, E.c.data)
        .where(E.c.request_id == request_id, E.c.kind.in_(kinds))
        .order_by(E.c.ts, E.c.seq)
    ).all()
    out = []
    for source_id, ts, kind, data in rows:
        d = msgspec.json.decode(data) if data else {}
        d.update(source_id=source_id, ts=ts, kind=kind)
        out.append(d)
    return out


def _engine_steps(
    conn: sa.Connection, source_id: str, lo: float, hi: float, *cols: sa.ColumnElement[Any]
) -> list[Any]:
    return list(
        conn.execute(
            sa.select(*cols).where(S.c.source_id == source_id, S.c.ts >= lo, S.c.ts <= hi).order_by(S.c.step)
        ).all()
    )


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


def request_itl(conn: sa.Connection, request_id: str) -> dict[str, Any] | None:
    """One request's inter-token gaps: its first token, then the end of every later step in which it
    sampled a token: every step it decoded in, and a step whose chunk completed a recompute after a
    preemption (``_silent_chunk_steps``); a chunk that left the prefill partial yields no token.

    None for an unknown request; ``n`` 0 when it has fewer than two tokens or no step rows."""
    row = _request_row(conn, request_id)
    if row is None:
        return None
    empty: dict[str, Any] = {"n": 0, **dict.fromkeys(QUANTILES), "max": None, "mean": None, "gaps": []}
    first, src = row["first_token_ts"], row["engine_source_id"]
    if first is None or src is None:
        return empty
    last = row["last_step_ts"] or row["last_token_ts"] or first
    silent, first_step = _silent_chunk_steps(
        _event_data(conn, request_id, ["chunk", "resumed", "tokens"]), src, row["prompt_tokens"]
    )
    steps = conn.execute(
        sa.select(S.c.step, (S.c.ts + S.c.duration_s).label("end"))
        .where(
            S.c.source_id == src,
            S.c.ts + S.c.duration_s > first + 1e-6,
            S.c.ts <= last,
            sa.literal(request_id) == sa.any_(S.c.request_ids),
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
    return {
        "n": len(gaps),
        **{k: _percentile(xs, q) for k, q in QUANTILES.items()},
        "max": xs[-1],
        "mean": sum(xs) / len(xs),
        "gaps": gaps,
    }


def why(conn: sa.Connection, request_id: str, *, top: int = 5) -> dict[str, Any] | None:
    """What delayed a request, biggest first, from the stored events and steps.

    Items: its admission wait at the gateway, its way through the engine's front end (``frontend``:
    HTTP, API server, tokenising, IPC; nobody to blame in the engine), its first wait in the engine's
    queue and every preemption's wait (with the requests that held the engine meanwhile, see
    ``_engine_holders``), the steps it sat out while holding KV (and whose prefills filled them), and
    its slowest decode steps (and the prefills that shared them). Each item has ``seconds`` and the
    ``culprits`` behind it.
    """
    row = _request_row(conn, request_id)
    if row is None:
        return None
    items: list[dict[str, Any]] = []
    src = row["engine_source_id"]
    if row["admission_s"] or row["admission_wait_s"]:
        items.append(
            {
                "kind": "admission_queue",
                "seconds": row["admission_s"] if row["admission_s"] is not None else row["admission_wait_s"],
                "start_ts": row["admission_enqueued_ts"],
                "detail": "waited in the gateway's admission queue (upstream at its in-flight limit)",
                "culprits": [],
            }
        )
    if row["frontend_s"]:
        forwarded = row["admitted_ts"] is not None
        items.append(
            {
                "kind": "frontend",
                "seconds": row["frontend_s"],
                "start_ts": row["admitted_ts"] if forwarded else row["engine_arrival_ts"],
                "detail": (
                    "between the gateway's hand-over and the engine's scheduler queue"
                    if forwarded
                    else "between the engine front end's arrival and its scheduler queue"
                )
                + " (HTTP, the API server, tokenising, IPC to the engine core)",
                "culprits": [],
            }
        )
    life = _event_data(conn, request_id, ["preempted", "resumed", "chunk"])
    queued, first_sched = row["queued_ts"], row["first_scheduled_ts"] or row["end_ts"]
    if src is not None and queued is not None and first_sched is not None and first_sched > queued:
        # the engine's own monotonic measure of the wait (its first chunk's wait_s) where it sent one
        first_chunk = min((d for d in life if d["kind"] == "chunk"), key=lambda d: d["ts"], default=None)
        measured = first_chunk.get("wait_s") if first_chunk is not None else None
        items.append(
            {
                "kind": "engine_queue",
                "seconds": measured if measured is not None else first_sched - queued,
                "start_ts": queued,
                "detail": "waited in the engine's queue before its first chunk",
                "culprits": _engine_holders(conn, src, row, queued, first_sched, top),
            }
        )
    own_chunks = {d["step"]: d.get("tokens", 0) for d in life if d["kind"] == "chunk" and "step" in d}
    pending: dict[str, Any] | None = None
    for d in life:
        if d["kind"] == "preempted":
            pending = d
        elif d["kind"] == "resumed" and pending is not None:
            items.append(
                {
                    "kind": "preempted",
                    "seconds": d.get("wait_s") or (d["ts"] - pending["ts"]),
                    "start_ts": pending["ts"],
                    "detail": f"preempted ({pending.get('reason', 'kv_pressure')}), "
                    f"{pending.get('kv_blocks_freed', 0)} KV blocks freed, "
                    f"{pending.get('computed_tokens', 0)} tokens to recompute",
                    "culprits": _engine_holders(conn, src, row, pending["ts"], d["ts"], top) if src else [],
                }
            )
            pending = None
    if src is not None and row["first_scheduled_ts"] is not None:
        hi = row["last_step_ts"] or row["end_ts"] or row["last_event_ts"]
        steps = _engine_steps(
            conn,
            src,
            row["first_scheduled_ts"] - 1e-9,
            hi,
            S.c.step,
            S.c.ts,
            S.c.duration_s,
            S.c.prefill_tokens,
            S.c.request_ids,
            S.c.stalled_request_ids,
        )
        sat_out = [s for s in steps if s.stalled_request_ids and request_id in s.stalled_request_ids]
        if sat_out:
            items.append(
                {
                    "kind": "sat_out",
                    "seconds": sum(s.duration_s for s in sat_out),
                    "start_ts": sat_out[0].ts,
                    "steps": [s.step for s in sat_out],
                    "detail": f"held its KV blocks through {len(sat_out)} steps it was left out of",
                    "culprits": _prefills_in_steps(conn, src, sat_out, request_id, top),
                }
            )
        first_tok = row["first_token_ts"]
        shared = _shared_prefill(request_id, own_chunks, steps, first_tok)
        if shared is not None:
            seconds, shared_steps, other_tokens = shared
            items.append(
                {
                    "kind": "shared_prefill",
                    "seconds": seconds,
                    "start_ts": shared_steps[0].ts,
                    "steps": [s.step for s in shared_steps],
                    "detail": f"its prefill shared {len(shared_steps)} steps with {other_tokens} "
                    "prefill tokens of other requests (their share of those steps)",
                    "culprits": _prefills_in_steps(conn, src, shared_steps, request_id, top),
                }
            )
        decode = [
            s for s in steps if first_tok is not None and s.ts >= first_tok and request_id in s.request_ids
        ]
        if decode:
            typical = _percentile(sorted(s.duration_s for s in decode), 0.5)
            slow = sorted((s for s in decode if s.prefill_tokens), key=lambda s: -s.duration_s)[:top]
            slow = [s for s in slow if s.duration_s > 1.5 * typical]
            if slow:
                items.append(
                    {
                        "kind": "shared_prefill_steps",
                        "seconds": sum(s.duration_s - typical for s in slow),
                        "start_ts": slow[0].ts,
                        "steps": [s.step for s in slow],
                        "detail": f"{len(slow)} decode steps shared with prefill chunks ran "
                        f"{max(s.duration_s for s in slow) / typical:.1f}x its typical step "
                        f"({typical * 1e3:.1f} ms)",
                        "culprits": _prefills_in_steps(conn, src, slow, request_id, top),
                    }
                )
    items.sort(key=lambda i: -(i["seconds"] or 0))
    layers = {
        k: row[k] for k in ("entry_s", "admission_s", "frontend_s", "engine_queue_s", "prefill_s", "decode_s")
    }
    return {
        "request_id": request_id,
        "e2e_s": row["e2e_s"],
        "ttft_s": row["ttft_s"],
        "client_ttft_s": row["client_ttft_s"],
        "layers": layers,
        "items": items,
    }


def _shared_prefill(
    request_id: str, own: dict[int, int], steps: Sequence[Any], first_tok: float | None
) -> tuple[float, list[Any], int] | None:
    """The steps that ran the request's own prefill chunks (``own``: step -> tokens) together with
    other requests' chunks, and the time those others took in them (duration split by tokens)."""
    seconds, shared, others = 0.0, [], 0
    for s in steps:
        if s.step not in own or request_id not in s.request_ids or not s.prefill_tokens:
            continue
        if first_tok is not None and s.ts >= first_tok:
            continue
        other = s.prefill_tokens - own[s.step]
        if other > 0:
            seconds += s.duration_s * other / s.prefill_tokens
            shared.append(s)
            others += other
    return (seconds, shared, others) if shared else None


def _engine_holders(
    conn: sa.Connection, source_id: str, row: dict[str, Any], lo: float, hi: float, top: int
) -> list[dict[str, Any]]:
    """The requests that held the engine while ``row``'s request waited in its queue (``lo`` to
    ``hi``): those that took part in the engine's steps in that time, ranked by their share of those
    steps' time (each step's duration split by tokens: a prefill chunk's tokens, one per decode).

    A request that reached the engine after this one (its front end's arrival) is not blamed: it could
    only be ahead because this one's own front end was slower (``frontend_s``). Without step rows the
    prefill chunks scheduled in the window stand in."""
    request_id = row["request_id"]
    steps = conn.execute(
        sa.select(S.c.step, S.c.ts, S.c.duration_s, S.c.prefill_tokens, S.c.request_ids)
        .where(S.c.source_id == source_id, S.c.ts < hi, S.c.ts + S.c.duration_s > lo + 1e-9)
        .order_by(S.c.step)
    ).all()
    if not steps:
        return _prefills_between(conn, source_id, lo, hi - 1e-9, request_id, top)
    chunks = conn.execute(
        sa.select(E.c.request_id, E.c.data).where(
            E.c.source_id == source_id,
            E.c.kind == "chunk",
            E.c.ts >= min(st.ts for st in steps),
            E.c.ts <= max(st.ts for st in steps),
        )
    ).all()
    in_step: dict[tuple[str, int], dict[str, Any]] = {}
    for rid, data in chunks:
        d = msgspec.json.decode(data)
        if "step" in d:
            in_step[(rid, d["step"])] = d
    share: dict[str, float] = defaultdict(float)
    took: dict[str, int] = defaultdict(int)
    prefill: dict[str, int] = defaultdict(int)
    n_chunks: dict[str, int] = defaultdict(int)
    depth: dict[str, int] = defaultdict(int)
    for st in steps:
        work = {}
        for rid in st.request_ids:
            chunk = in_step.get((rid, st.step))
            work[rid] = chunk.get("tokens", 0) if chunk is not None else 1
            if chunk is not None:
                prefill[rid] += work[rid]
                n_chunks[rid] += 1
                depth[rid] = max(depth[rid], chunk.get("computed_before", 0) + work[rid])
        total = sum(work.values()) or 1
        for rid, w in work.items():
            share[rid] += st.duration_s * w / total
            took[rid] += 1
    share.pop(request_id, None)
    if not share:
        return []
    mine = row["engine_arrival_ts"] if row["engine_arrival_ts"] is not None else row["queued_ts"]
    facts = {
        r.request_id: r
        for r in conn.execute(
            sa.select(
                R.c.request_id, R.c.engine_arrival_ts, R.c.queued_ts, R.c.prompt_tokens, R.c.chunks
            ).where(R.c.request_id.in_(list(share)))
        )
    }
    out = []
    for rid in sorted(share, key=lambda r: -share[r]):
        f = facts.get(rid)
        came = (
            None if f is None else (f.engine_arrival_ts if f.engine_arrival_ts is not None else f.queued_ts)
        )
        if mine is not None and came is not None and came > mine:
            continue
        out.append(
            {
                "request_id": rid,
                "share_s": share[rid],
                "steps": took[rid],
                "prefill_tokens": prefill[rid],
                "chunks": n_chunks[rid],
                "decode_steps": took[rid] - n_chunks[rid],
                "max_depth": depth[rid],
                "prompt_tokens": f.prompt_tokens if f is not None else None,
                "request_chunks": f.chunks if f is not None else None,
            }
        )
        if len(out) == top:
            break
    return out


def _prefills_between(
    conn: sa.Connection, source_id: str, lo: float, hi: float, exclude: str, top: int
) -> list[dict[str, Any]]:
    """The requests whose prefill chunks ran on ``source_id`` in [lo, hi], most tokens first."""
    rows = conn.execute(
        sa.select(E.c.request_id, E.c.data)
        .where(E.c.source_id == source_id, E.c.kind == "chunk", E.c.ts >= lo, E.c.ts <= hi)
        .where(E.c.request_id != exclude)
    ).all()
    return _rank_chunks(conn, rows, top)


def _prefills_in_steps(
    conn: sa.Connection, source_id: str, steps: Sequence[Any], exclude: str, top: int
) -> list[dict[str, Any]]:
    """The requests whose prefill chunks ran in these step rows (they carry ``step`` and ``ts``)."""
    if not steps:
        return []
    rows = conn.execute(
        sa.select(E.c.request_id, E.c.data).where(
            E.c.source_id == source_id,
            E.c.kind == "chunk",
            E.c.request_id != exclude,
            E.c.ts >= min(s.ts for s in steps),
            E.c.ts <= max(s.ts for s in steps),
        )
    ).all()
    return _rank_chunks(conn, rows, top, only_steps={s.step for s in steps})


def _rank_chunks(
    conn: sa.Connection, rows: Sequence[Any], top: int, only_steps: set[int] | None = None
) -> list[dict[str, Any]]:
    """Culprits, most prefill tokens first: ``prefill_tokens``, ``chunks`` and ``max_depth`` count the
    chunks in ``rows`` (the item's window or steps); ``prompt_tokens`` and ``request_chunks`` are the
    culprit's whole prompt and all its chunks (from its request row), so a long prompt whose last chunk
    alone shared a step is still named as what it is."""
    tokens: dict[str, int] = defaultdict(int)
    chunks: dict[str, int] = defaultdict(int)
    depth: dict[str, int] = defaultdict(int)
    for rid, data in rows:
        d = msgspec.json.decode(data)
        if only_steps is not None and d.get("step") not in only_steps:
            continue
        tokens[rid] += d.get("tokens", 0)
        chunks[rid] += 1
        depth[rid] = max(depth[rid], d.get("computed_before", 0) + d.get("tokens", 0))
    ranked = sorted(tokens, key=lambda r: -tokens[r])[:top]
    whole: dict[str, Any] = {}
    if ranked:
        whole = {
            r.request_id: r
            for r in conn.execute(
                sa.select(R.c.request_id, R.c.prompt_tokens, R.c.chunks).where(R.c.request_id.in_(ranked))
            )
        }
    out = []
    for r in ranked:
        row = whole.get(r)
        out.append(
            {
                "request_id": r,
                "prefill_tokens": tokens[r],
                "chunks": chunks[r],
                "max_depth": depth[r],
                "prompt_tokens": row.prompt_tokens if row is not None else None,
                "request_chunks": row.chunks if row is not None else None,
            }
        )
    return out


def kv_stalls(
    conn: sa.Connection, now: float, *, limit: int = 50, horizon_s: float = 3600.0
) -> list[dict[str, Any]]:
    """Live requests ranked by how long they have gone without progress.

    Running requests (scheduled at least once) stall from their last step or token; waiting ones
    (queued, never scheduled) from when they were queued. Requests with no event for ``horizon_s``
    are left out (their engine is gone). ``kv_idle_s`` is the idle time already folded from steps.
    """
    if not 1 <= limit <= MAX_PAGE:
        raise QueryError("limit", f"must be between 1 and {MAX_PAGE}")
    since_progress = sa.func.coalesce(
        sa.func.greatest(R.c.last_step_ts, R.c.last_token_ts), R.c.first_scheduled_ts, R.c.queued_ts
    )
    stall = (sa.literal(now) - since_progress).label("stall_s")
    state = sa.case((R.c.first_scheduled_ts.is_(None), "waiting"), else_="running").label("state")
    stmt = (
        sa.select(
            R.c.request_id,
            R.c.model,
            R.c.engine_source_id,
            state,
            stall,
            R.c.kv_idle_s,
            R.c.kv_idle_block_s,
            R.c.kv_blocks_max,
            R.c.preemptions,
            R.c.output_tokens,
            R.c.prompt_tokens,
            R.c.queued_ts,
        )
        .where(R.c.end_ts.is_(None), R.c.queued_ts.is_not(None), R.c.last_event_ts >= now - horizon_s)
        .order_by(stall.desc(), R.c.request_id)
        .limit(limit)
    )
    return [dict(r) for r in conn.execute(stmt).mappings()]
