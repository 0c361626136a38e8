"""Tails of the layers over a window (``attribution``) and the request list (``list_requests``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from ledger.analytics.answers import METRICS, AttributionGroup, Layers, Tails
from ledger.analytics.common import (
    MAX_PAGE,
    QUANTILES,
    QueryError,
    R,
    in_window,
)
from ledger.analytics.window import Window
from ledger.records import UNSET
from ledger.rows import RequestList, RequestRow

GROUPS = {
    "model": R.c.model,
    "engine_source_id": R.c.engine_source_id,
    "gateway_source_id": R.c.gateway_source_id,
    "finish_reason": R.c.finish_reason,
}


SORTABLE = frozenset(c.name for c in R.columns)


def _tails(col: sa.ColumnElement[Any], name: str) -> list[sa.ColumnElement[Any]]:
    out: list[sa.ColumnElement[Any]] = [
        sa.func.percentile_cont(q).within_group(col).label(f"{name}__{k}") for k, q in QUANTILES.items()
    ]
    out.append(sa.func.max(col).label(f"{name}__max"))
    out.append(sa.func.avg(col).label(f"{name}__mean"))
    out.append(sa.func.count(col).label(f"{name}__n"))
    return out


def _summary(row: sa.RowMapping, name: str) -> Tails:
    return Tails(**{k: row[f"{name}__{k}"] for k in ("n", *QUANTILES, "max", "mean")})


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
    max_buckets: int | None = None,
) -> list[AttributionGroup]:
    """Finished requests (by end time) in the window: count and tails of every layer, TTFT, e2e.

    One entry per group (and per time bucket when ``bucket_s`` is set, keyed by the bucket start).
    ``max_buckets``: a ``bucket_s`` that cuts the ends found in the window into more buckets is
    refused (QueryError naming bucket_s) before the tails are computed.
    """
    groups = _group_cols(group_by)
    cols: list[sa.ColumnElement[Any]] = [*groups, sa.func.count().label("requests")]
    if bucket_s is not None:
        if not (bucket_s > 0 and math.isfinite(bucket_s)):
            raise QueryError("bucket_s", "must be a positive number of seconds")
        if max_buckets is not None:
            span = conn.execute(
                in_window(
                    sa.select(sa.func.min(R.c.end_ts), sa.func.max(R.c.end_ts)).where(
                        R.c.end_ts.is_not(None)
                    ),
                    window,
                    R.c.end_ts,
                )
            ).one()
            if span[0] is not None and (span[1] - span[0]) / bucket_s + 1 > max_buckets:
                raise QueryError(
                    "bucket_s",
                    f"{bucket_s:g} s cuts the window's {span[1] - span[0]:.0f} s of finished requests into "
                    f"more than {max_buckets} buckets (attribution_max_buckets); use bucket_s >= "
                    f"{(span[1] - span[0]) / max(1, max_buckets - 1):.3g}",
                )
        bucket = (sa.func.floor(R.c.end_ts / bucket_s) * bucket_s).label("bucket_ts")
        cols.insert(0, bucket)
        groups = [bucket, *groups]
    for m in METRICS:
        cols += _tails(R.c[m], m)
    cols.append(sa.func.sum(R.c.output_tokens).label("output_tokens"))
    cols.append(sa.func.sum(R.c.preemptions).label("preemptions"))
    stmt = in_window(sa.select(*cols).where(R.c.end_ts.is_not(None)), window, R.c.end_ts)
    if groups:
        stmt = stmt.group_by(*groups).order_by(*groups)
    out = []
    for row in conn.execute(stmt).mappings():
        if not row["requests"]:
            continue
        out.append(
            AttributionGroup(
                **{g: row[g] for g in group_by},
                bucket_ts=row["bucket_ts"] if bucket_s is not None else UNSET,
                requests=row["requests"],
                output_tokens=int(row["output_tokens"] or 0),
                preemptions=int(row["preemptions"] or 0),
                layers=Layers(**{m: _summary(row, m) for m in METRICS}),
            )
        )
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
) -> RequestList:
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
    base = in_window(sa.select(R).where(*where), window, R.c.start_ts)
    total = conn.execute(sa.select(sa.func.count()).select_from(base.subquery())).scalar_one()
    key = R.c[sort].desc() if descending else R.c[sort].asc()
    nulls = key.nulls_last()
    page = base.order_by(nulls, R.c.request_id).limit(limit).offset(offset)
    rows = [RequestRow(**r) for r in conn.execute(page).mappings()]
    return RequestList(total=total, offset=offset, limit=limit, sort=sort, rows=rows)
