"""The fleet's engines over a window (``engine_load``): by model, and the engines worst right now.

A fleet of hundreds of engines cannot be drawn one line per engine. The steps are aggregated per
engine and time bucket in one scan (``steps`` by ``ts``: DuckDB's zone maps skip the row groups
outside the window), then, in Python over those few thousand rows: each engine's newest bucket ranks
it (``rank_by``), the ``top`` worst and the engines asked for by id are series of their own, and every
model is a series twice, all its engines and the ones not shown on their own ("rest").
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa

from ledger import schema
from ledger.analytics.answers import RANK_BY, EngineLoad, EngineNow, EnginePoint
from ledger.analytics.common import MAX_PAGE, QueryError, S, in_window
from ledger.analytics.window import Window

TOP_DEFAULT = 8
TOP_MAX = 50


def _per_engine(conn: sa.Connection, window: Window, bucket_s: float) -> list[sa.Row[Any]]:
    bucket = (sa.func.floor(S.c.ts / bucket_s) * bucket_s).label("bucket_ts")
    stmt = sa.select(
        S.c.source_id,
        bucket,
        sa.func.count().label("steps"),
        sa.func.max(S.c.ts + S.c.duration_s).label("last_step_ts"),
        sa.func.max(S.c.kv_usage).label("kv_max"),
        sa.func.sum(S.c.kv_usage).label("kv_sum"),
        sa.func.max(S.c.waiting).label("waiting_max"),
        sa.func.max(S.c.running).label("running_max"),
        sa.func.sum(S.c.duration_s).label("dur_sum"),
        sa.func.max(S.c.duration_s).label("dur_max"),
    ).group_by(S.c.source_id, bucket)
    return list(conn.execute(in_window(stmt, window, S.c.ts)).all())


def _check(conn: sa.Connection, window: Window, bucket_s: float, top: int, rank_by: str, most: int) -> None:
    if not (bucket_s > 0 and math.isfinite(bucket_s)):
        raise QueryError("bucket_s", "must be a positive number of seconds")
    if not 0 <= top <= TOP_MAX:
        raise QueryError("top", f"must be between 0 and {TOP_MAX}")
    if rank_by not in RANK_BY:
        raise QueryError("rank_by", f"unknown {rank_by!r}; one of {', '.join(RANK_BY)}")
    span = sa.select(sa.func.min(S.c.ts), sa.func.max(S.c.ts))
    lo, hi = conn.execute(in_window(span, window, S.c.ts)).one()
    if lo is not None and (hi - lo) / bucket_s + 1 > most:
        raise QueryError(
            "bucket_s",
            f"{bucket_s:g} s cuts the window's {hi - lo:.0f} s of steps into more than {most} buckets "
            f"(attribution_max_buckets); use bucket_s >= {(hi - lo) / max(1, most - 1):.3g}",
        )


def engine_load(
    conn: sa.Connection,
    window: Window = Window(),
    *,
    bucket_s: float = 60.0,
    top: int = TOP_DEFAULT,
    rank_by: str = "kv_usage",
    source_ids: Sequence[str] = (),
    max_buckets: int = MAX_PAGE,
) -> EngineLoad:
    """The window's steps per time bucket: by model, the ``top`` worst engines now (by their newest
    bucket's ``rank_by``: KV in use, requests waiting, mean step time) and ``source_ids`` on their own,
    the rest of each model together; every engine ranked worst first."""
    _check(conn, window, bucket_s, top, rank_by, max_buckets)
    rows = _per_engine(conn, window, bucket_s)
    src = schema.sources
    models = dict(conn.execute(sa.select(src.c.source_id, src.c.model)).all())
    newest: dict[str, Any] = {}
    for r in rows:
        if r.source_id not in newest or r.bucket_ts > newest[r.source_id].bucket_ts:
            newest[r.source_id] = r
    ranked = sorted(newest.values(), key=lambda r: (-_rank_value(r, rank_by), r.source_id))
    shown = {r.source_id for r in ranked[:top]} | set(source_ids)
    engines = [
        EngineNow(
            source_id=r.source_id,
            model=models.get(r.source_id),
            rank=i,
            shown=r.source_id in shown,
            bucket_ts=float(r.bucket_ts),
            last_step_ts=float(r.last_step_ts),
            kv_usage=float(r.kv_max),
            waiting=int(r.waiting_max),
            running=int(r.running_max),
            step_s=float(r.dur_sum) / r.steps,
        )
        for i, r in enumerate(ranked, 1)
    ]
    series: dict[tuple[float, str, str, str | None], list[Any]] = defaultdict(list)
    for r in rows:
        model = models.get(r.source_id)
        series[float(r.bucket_ts), model or "", "model", model].append(r)
        if r.source_id in shown:
            series[float(r.bucket_ts), r.source_id, "engine", model].append(r)
        else:
            series[float(r.bucket_ts), model or "", "rest", model].append(r)
    points = [_point(key, members) for key, members in sorted(series.items(), key=lambda kv: kv[0][:3])]
    return EngineLoad(
        since=window.since,
        until=window.until,
        bucket_s=bucket_s,
        rank_by=rank_by,  # type: ignore[arg-type]
        top=top,
        engines=engines,
        points=points,
    )


def _rank_value(r: Any, rank_by: str) -> float:
    if rank_by == "waiting":
        return float(r.waiting_max)
    if rank_by == "step_s":
        return float(r.dur_sum) / r.steps
    return float(r.kv_max)


def _point(key: tuple[float, str, str, str | None], rows: Iterable[Any]) -> EnginePoint:
    rows = list(rows)
    steps = sum(r.steps for r in rows)
    bucket_ts, name, kind, model = key
    return EnginePoint(
        bucket_ts=bucket_ts,
        series=name,
        kind=kind,  # type: ignore[arg-type]
        model=model,
        engines=len(rows),
        steps=steps,
        kv_usage_max=max(float(r.kv_max) for r in rows),
        kv_usage_mean=sum(float(r.kv_sum) for r in rows) / steps,
        waiting_max=max(int(r.waiting_max) for r in rows),
        waiting_mean=sum(int(r.waiting_max) for r in rows) / len(rows),
        running_max=max(int(r.running_max) for r in rows),
        step_s_mean=sum(float(r.dur_sum) for r in rows) / steps,
        step_s_max=max(float(r.dur_max) for r in rows),
    )
