"""What delayed one request, biggest first, with the requests behind each delay (``why``).

The answer is built in named stages, which the API, the CLI (through the API) and the tests call
through :func:`why`:

1. :func:`load_request`: the request's row (None: no such request);
2. :func:`gateway_items`: its waits before the engine (admission queue, front end), from the row alone;
3. :func:`engine_wait_items`: its waits in the engine's queue (first and after each preemption), with
   the requests that held the engine meanwhile (:func:`_engine_holders`);
4. :func:`load_steps`: the engine steps of its life there (its neighbours in the batch);
5. :func:`step_items`: the steps it sat out holding KV, and the steps its prefill or decode shared
   with other requests' prefill chunks, with those requests;
6. :func:`attribute`: every item, biggest first, in the :class:`~ledger.analytics.why_answer.Why` record.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import msgspec
import sqlalchemy as sa

from ledger.analytics.common import (
    E,
    R,
    S,
    engine_steps,
    event_data,
    percentile,
    ran_in_step,
    request_row,
    started_by,
    steps_with_ids,
)
from ledger.analytics.why_answer import Culprit, Why, WhyItem, WhyLayers, WhyQuery
from ledger.rows import RequestRow


def why(conn: sa.Connection, query: WhyQuery) -> Why | None:
    """What delayed a request, biggest first, from the stored events and steps (None: no such request).

    Items: its admission wait at the gateway, its way through the engine's front end (``frontend``:
    HTTP, API server, tokenising, IPC; nobody to blame in the engine), its first wait in the engine's
    queue and every preemption's wait (with the requests that held the engine meanwhile, see
    ``_engine_holders``), the steps it sat out while holding KV (and whose prefills filled them), and
    its slowest decode steps (and the prefills that shared them). Each item has ``seconds`` and the
    ``culprits`` behind it.
    """
    row = load_request(conn, query.request_id)
    if row is None:
        return None
    life = event_data(conn, query.request_id, ["preempted", "resumed", "chunk"])
    items = gateway_items(row) + engine_wait_items(conn, row, life, query.top)
    steps = load_steps(conn, row)
    if steps:
        items += step_items(conn, row, life, steps, query.top)
    return attribute(row, items)


def load_request(conn: sa.Connection, request_id: str) -> RequestRow | None:
    """The request's row of the ``requests`` view."""
    return request_row(conn, request_id)


def gateway_items(row: RequestRow) -> list[WhyItem]:
    """Its wait in the gateway's admission queue and its way through the engine's front end."""
    items = []
    if row.admission_s or row.admission_wait_s:
        items.append(
            WhyItem(
                kind="admission_queue",
                seconds=row.admission_s if row.admission_s is not None else row.admission_wait_s,
                start_ts=row.admission_enqueued_ts,
                detail="waited in the gateway's admission queue (upstream at its in-flight limit)",
                culprits=[],
            )
        )
    if row.frontend_s:
        forwarded = row.admitted_ts is not None
        items.append(
            WhyItem(
                kind="frontend",
                seconds=row.frontend_s,
                start_ts=row.admitted_ts if forwarded else row.engine_arrival_ts,
                detail=(
                    "between the gateway's hand-over and the engine's scheduler queue"
                    if forwarded
                    else "between the engine front end's arrival and its scheduler queue"
                )
                + " (HTTP, the API server, tokenising, IPC to the engine core)",
                culprits=[],
            )
        )
    return items


def engine_wait_items(
    conn: sa.Connection, row: RequestRow, life: list[dict[str, Any]], top: int
) -> list[WhyItem]:
    """Its first wait in the engine's queue and each preemption's wait, with who held the engine."""
    items = []
    src = row.engine_source_id
    queued, first_sched = row.queued_ts, row.first_scheduled_ts or row.end_ts
    if src is not None and queued is not None and first_sched is not None and first_sched > queued:
        # the engine's own monotonic measure of the wait (its first chunk's wait_s) where it sent one
        first_chunk = min((d for d in life if d["kind"] == "chunk"), key=lambda d: d["ts"], default=None)
        measured = first_chunk.get("wait_s") if first_chunk is not None else None
        items.append(
            WhyItem(
                kind="engine_queue",
                seconds=measured if measured is not None else first_sched - queued,
                start_ts=queued,
                detail="waited in the engine's queue before its first chunk",
                culprits=_engine_holders(conn, src, row, queued, first_sched, top),
            )
        )
    pending: dict[str, Any] | None = None
    for d in life:
        if d["kind"] == "preempted":
            pending = d
        elif d["kind"] == "resumed" and pending is not None:
            items.append(
                WhyItem(
                    kind="preempted",
                    seconds=d.get("wait_s") or (d["ts"] - pending["ts"]),
                    start_ts=pending["ts"],
                    detail=f"preempted ({pending.get('reason', 'kv_pressure')}), "
                    f"{pending.get('kv_blocks_freed', 0)} KV blocks freed, "
                    f"{pending.get('computed_tokens', 0)} tokens to recompute",
                    culprits=_engine_holders(conn, src, row, pending["ts"], d["ts"], top) if src else [],
                )
            )
            pending = None
    return items


def load_steps(conn: sa.Connection, row: RequestRow) -> list[Any]:
    """The engine's steps from the request's first scheduling to its last step (empty: it never ran),
    each with whether the request ran in it (``ran``) rather than the ids of every request it ran: a
    busy engine's steps name hundreds, and turning a long request's 3M keys into ids took seconds."""
    src = row.engine_source_id
    if src is None or row.first_scheduled_ts is None:
        return []
    hi = row.last_step_ts or row.end_ts or row.last_event_ts
    ran = ran_in_step(row.request_id).label("ran")
    return engine_steps(
        conn,
        src,
        row.first_scheduled_ts - 1e-9,
        hi,
        S.c.step,
        S.c.ts,
        S.c.duration_s,
        S.c.prefill_tokens,
        S.c.stalled_request_ids,
        ran,
    )


def step_items(
    conn: sa.Connection, row: RequestRow, life: list[dict[str, Any]], steps: list[Any], top: int
) -> list[WhyItem]:
    """The steps it sat out holding KV, and those its prefill and its decodes shared with other prefills."""
    request_id, src = row.request_id, row.engine_source_id
    items = []
    sat_out = [s for s in steps if s.stalled_request_ids and request_id in s.stalled_request_ids]
    if sat_out:
        items.append(
            WhyItem(
                kind="sat_out",
                seconds=sum(s.duration_s for s in sat_out),
                start_ts=sat_out[0].ts,
                steps=[s.step for s in sat_out],
                detail=f"held its KV blocks through {len(sat_out)} steps it was left out of",
                culprits=_prefills_in_steps(conn, src, sat_out, request_id, top),
            )
        )
    own_chunks = {d["step"]: d.get("tokens", 0) for d in life if d["kind"] == "chunk" and "step" in d}
    shared = _shared_prefill(request_id, own_chunks, steps, row.first_token_ts)
    if shared is not None:
        seconds, shared_steps, other_tokens = shared
        items.append(
            WhyItem(
                kind="shared_prefill",
                seconds=seconds,
                start_ts=shared_steps[0].ts,
                steps=[s.step for s in shared_steps],
                detail=f"its prefill shared {len(shared_steps)} steps with {other_tokens} "
                "prefill tokens of other requests (their share of those steps)",
                culprits=_prefills_in_steps(conn, src, shared_steps, request_id, top),
            )
        )
    slow = _slow_decode_item(conn, row, steps, top)
    return items + ([slow] if slow is not None else [])


def _slow_decode_item(conn: sa.Connection, row: RequestRow, steps: list[Any], top: int) -> WhyItem | None:
    """Its decode steps that shared the step with a prefill and ran over 1.5x its typical step."""
    request_id, first_tok = row.request_id, row.first_token_ts
    decode = [s for s in steps if first_tok is not None and s.ts >= first_tok and s.ran]
    if not decode:
        return None
    typical = percentile(sorted(s.duration_s for s in decode), 0.5)
    slow = sorted((s for s in decode if s.prefill_tokens), key=lambda s: -s.duration_s)[:top]
    slow = [s for s in slow if s.duration_s > 1.5 * typical]
    if not slow:
        return None
    return WhyItem(
        kind="shared_prefill_steps",
        seconds=sum(s.duration_s - typical for s in slow),
        start_ts=slow[0].ts,
        steps=[s.step for s in slow],
        detail=f"{len(slow)} decode steps shared with prefill chunks ran "
        f"{max(s.duration_s for s in slow) / typical:.1f}x its typical step "
        f"({typical * 1e3:.1f} ms)",
        culprits=_prefills_in_steps(conn, row.engine_source_id, slow, request_id, top),
    )


def attribute(row: RequestRow, items: list[WhyItem]) -> Why:
    """The answer: the request's layers and its delays, biggest first."""
    items.sort(key=lambda i: -(i.seconds or 0))
    return Why(
        request_id=row.request_id,
        e2e_s=row.e2e_s,
        ttft_s=row.ttft_s,
        client_ttft_s=row.client_ttft_s,
        layers=WhyLayers(**{f: getattr(row, f) for f in WhyLayers.__struct_fields__}),
        items=items,
    )


def _shared_prefill(
    request_id: str, own: dict[int, int], steps: Sequence[Any], first_tok: float | None
) -> tuple[float, list[Any], int] | None:
    """The steps that ran the request's own prefill chunks (``own``: step -> tokens) together with
    other requests' chunks, and the time those others took in them (duration split by tokens)."""
    seconds, shared, others = 0.0, [], 0
    for s in steps:
        if s.step not in own or not s.ran or not s.prefill_tokens:
            continue
        if first_tok is not None and s.ts >= first_tok:
            continue
        other = s.prefill_tokens - own[s.step]
        if other > 0:
            seconds += s.duration_s * other / s.prefill_tokens
            shared.append(s)
            others += other
    return (seconds, shared, others) if shared else None


class _Held(msgspec.Struct):
    """What one request did in the steps of a window: its share of their time and its chunks."""

    share_s: float = 0.0
    steps: int = 0
    prefill_tokens: int = 0
    chunks: int = 0
    max_depth: int = 0


def _engine_holders(
    conn: sa.Connection, source_id: str, row: RequestRow, lo: float, hi: float, top: int
) -> list[Culprit]:
    """The requests that held the engine while ``row``'s request waited in its queue (``lo`` to
    ``hi``): those that took part in the engine's steps in that time, ranked by their share of those
    steps' time (each step's duration split by tokens: a prefill chunk's tokens, one per decode).

    A request that reached the engine after this one (its front end's arrival) is not blamed: it could
    only be ahead because this one's own front end was slower (``frontend_s``). Without step rows the
    prefill chunks scheduled in the window stand in."""
    request_id = row.request_id
    steps = steps_with_ids(
        conn,
        sa.select(S.c.step, S.c.ts, S.c.duration_s, S.c.prefill_tokens, S.c.request_keys)
        .where(
            S.c.source_id == source_id,
            S.c.ts >= started_by(conn, source_id, lo),
            S.c.ts < hi,
            S.c.ts + S.c.duration_s > lo + 1e-9,
        )
        .order_by(S.c.step),
    )
    if not steps:
        return _prefills_between(conn, source_id, lo, hi - 1e-9, request_id, top)
    held = _held_in_steps(conn, source_id, steps)
    held.pop(request_id, None)
    if not held:
        return []
    mine = row.engine_arrival_ts if row.engine_arrival_ts is not None else row.queued_ts
    facts = {
        r.request_id: r
        for r in conn.execute(
            sa.select(
                R.c.request_id, R.c.engine_arrival_ts, R.c.queued_ts, R.c.prompt_tokens, R.c.chunks
            ).where(R.c.request_id.in_(list(held)))
        )
    }
    out = []
    for rid in sorted(held, key=lambda r: -held[r].share_s):
        f, h = facts.get(rid), held[rid]
        came = (
            None if f is None else (f.engine_arrival_ts if f.engine_arrival_ts is not None else f.queued_ts)
        )
        if mine is not None and came is not None and came > mine:
            continue
        out.append(
            Culprit(
                request_id=rid,
                share_s=h.share_s,
                steps=h.steps,
                prefill_tokens=h.prefill_tokens,
                chunks=h.chunks,
                decode_steps=h.steps - h.chunks,
                max_depth=h.max_depth,
                prompt_tokens=f.prompt_tokens if f is not None else None,
                request_chunks=f.chunks if f is not None else None,
            )
        )
        if len(out) == top:
            break
    return out


def _held_in_steps(conn: sa.Connection, source_id: str, steps: Sequence[Any]) -> dict[str, _Held]:
    """Per request that took part in ``steps``: its share of their time (each step's duration split by
    tokens: a prefill chunk's tokens, one per decode), the steps, and its prefill chunks among them."""
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
    held: dict[str, _Held] = defaultdict(_Held)
    for st in steps:
        work = {}
        for rid in st.request_ids:
            chunk = in_step.get((rid, st.step))
            work[rid] = chunk.get("tokens", 0) if chunk is not None else 1
            if chunk is not None:
                h = held[rid]
                h.prefill_tokens += work[rid]
                h.chunks += 1
                h.max_depth = max(h.max_depth, chunk.get("computed_before", 0) + work[rid])
        total = sum(work.values()) or 1
        for rid, w in work.items():
            held[rid].share_s += st.duration_s * w / total
            held[rid].steps += 1
    return held


def _prefills_between(
    conn: sa.Connection, source_id: str, lo: float, hi: float, exclude: str, top: int
) -> list[Culprit]:
    """The requests whose prefill chunks ran on ``source_id`` in [lo, hi], most tokens first."""
    rows = conn.execute(
        sa.select(E.c.request_id, E.c.data)
        .where(E.c.source_id == source_id, E.c.kind == "chunk", E.c.ts >= lo, E.c.ts <= hi)
        .where(E.c.request_id != exclude)
    ).all()
    return _rank_chunks(conn, rows, top)


def _prefills_in_steps(
    conn: sa.Connection, source_id: str, steps: Sequence[Any], exclude: str, top: int
) -> list[Culprit]:
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
) -> list[Culprit]:
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
    whole: dict[str, sa.Row[Any, Any, Any]] = {}
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
            Culprit(
                request_id=r,
                prefill_tokens=tokens[r],
                chunks=chunks[r],
                max_depth=depth[r],
                prompt_tokens=row.prompt_tokens if row is not None else None,
                request_chunks=row.chunks if row is not None else None,
            )
        )
    return out
