"""Read-only analytics endpoints (read token): attribution, request lists, ITL, why, KV stalls, engines.

Every handler is a thin wrapper over a named query in ``ledger.analytics.queries``; parameter errors
answer 422 naming the field, like the ingest endpoint. Each answer is a record (``ledger.analytics.answers``,
``ledger.analytics.why_answer``, ``ledger.rows``) sent as the query built it, without validating it again
(the answers can hold thousands of rows); the document's schema is generated from the same record.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Path, Query, Response, status

from ledger.analytics import queries as q
from ledger.analytics.answers import RANK_BY, Attribution, EngineLoad, Itl, KvStalls, RequestItl
from ledger.analytics.why_answer import TOP_DEFAULT
from ledger.analytics.window import BadTime, Window
from ledger.api import errors
from ledger.api.answers import documents, encoded
from ledger.api.deps import ReadsDep, SettingsDep, require
from ledger.api.queries import query_param
from ledger.reads import Reads
from ledger.rows import RequestList

router = APIRouter(prefix="/v1", tags=["analytics"], dependencies=[require("read")])

T = TypeVar("T")
Since = Annotated[str | None, Query(description="unix seconds, ISO 8601, or an age like 15m / 2h / 1d")]
Until = Annotated[str | None, Query(description="same forms as since; default now")]
RequestId = Annotated[str, Path(min_length=1, max_length=256)]


def _bad(field: str, reason: str) -> errors.ApiError:
    return errors.ApiError(status.HTTP_422_UNPROCESSABLE_CONTENT, f"{field}: {reason}", reason="invalid")


@contextmanager
def _params() -> Iterator[None]:
    try:
        yield
    except q.QueryError as exc:
        raise _bad(exc.field, exc.reason) from None


def _window(since: str | None, until: str | None) -> Window:
    try:
        return Window.parse(since, until)
    except BadTime as exc:
        raise _bad("since/until", str(exc)) from None


def _read(reads: Reads, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """``fn`` on a read connection (``ledger.reads``: its own pool and time limit, never ingest's)."""
    with _params(), reads.connect() as conn:
        return fn(conn, *args, **kw)


@router.get("/attribution", **documents(Attribution, 422))
def attribution(
    reads: ReadsDep,
    settings: SettingsDep,
    since: Since = None,
    until: Until = None,
    group_by: Annotated[str, Query(description="comma-separated: " + ", ".join(q.GROUPS))] = "",
    bucket_s: Annotated[float | None, Query(gt=0, description="also bucket by end time")] = None,
) -> Response:
    """Per-layer tails (count, p50, p90, p99, max, mean) of finished requests, by end time, with the
    decode inter-token latency of the same window."""
    w = _window(since, until)
    groups = [g.strip() for g in group_by.split(",") if g.strip()]
    most = settings.attribution_max_buckets
    rows = _read(reads, q.attribution, w, group_by=groups, bucket_s=bucket_s, max_buckets=most)
    itl = _read(reads, q.decode_itl, w, group_by_model="model" in groups)
    return encoded(Attribution(since=w.since, until=w.until, group_by=groups, groups=rows, itl=itl))


@router.get("/requests", **documents(RequestList, 422))
def list_requests(
    reads: ReadsDep,
    since: Since = None,
    until: Until = None,
    model: str | None = None,
    source_id: str | None = None,
    finish_reason: str | None = None,
    live: bool | None = None,
    min_e2e_s: float | None = None,
    min_ttft_s: float | None = None,
    sort: Annotated[str, Query(description="any column of the requests view")] = "end_ts",
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
    limit: Annotated[int, Query(ge=1, le=q.MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> Response:
    """Requests whose start falls in the window, filtered and sorted by any column, a page at a time."""
    return encoded(
        _read(
            reads,
            q.list_requests,
            _window(since, until),
            model=model,
            source_id=source_id,
            finish_reason=finish_reason,
            live=live,
            min_e2e_s=min_e2e_s,
            min_ttft_s=min_ttft_s,
            sort=sort,
            descending=order == "desc",
            limit=limit,
            offset=offset,
        )
    )


@router.get("/itl", **documents(Itl, 422))
def itl(reads: ReadsDep, since: Since = None, until: Until = None, by_model: bool = False) -> Response:
    """Decode inter-token latency tails over the window, from the engines' steps."""
    w = _window(since, until)
    rows = _read(reads, q.decode_itl, w, group_by_model=by_model)
    return encoded(Itl(since=w.since, until=w.until, itl=rows))


@router.get("/requests/{request_id}/itl", **documents(RequestItl, 404, 422))
def request_itl(reads: ReadsDep, request_id: RequestId) -> Response:
    """One request's inter-token gaps and their tails."""
    out = _read(reads, q.request_itl, request_id)
    if out is None:
        raise errors.ApiError(status.HTTP_404_NOT_FOUND, f"no request {request_id!r} in the ledger")
    return encoded(out)


@router.get("/requests/{request_id}/why", **documents(q.Why, 404, 422))
def why(
    reads: ReadsDep,
    request_id: RequestId,
    top: Annotated[int, query_param(q.WhyQuery, "top")] = TOP_DEFAULT,
) -> Response:
    """What delayed the request, biggest first, with the requests behind each delay."""
    out = _read(reads, q.why, q.WhyQuery(request_id=request_id, top=top))
    if out is None:
        raise errors.ApiError(status.HTTP_404_NOT_FOUND, f"no request {request_id!r} in the ledger")
    return encoded(out)


@router.get("/kv/stalls", **documents(KvStalls, 422))
def kv_stalls(
    reads: ReadsDep,
    limit: Annotated[int, Query(ge=1, le=q.MAX_PAGE)] = 50,
    horizon_s: Annotated[float, Query(gt=0)] = 3600.0,
) -> Response:
    """Live requests ranked by seconds without progress (KV held idle, or waiting to start)."""
    now = time.time()
    return encoded(
        KvStalls(now=now, requests=_read(reads, q.kv_stalls, now, limit=limit, horizon_s=horizon_s))
    )


@router.get("/engines", **documents(EngineLoad, 422))
def engines(
    reads: ReadsDep,
    settings: SettingsDep,
    since: Since = None,
    until: Until = None,
    bucket_s: Annotated[float, Query(gt=0, description="time bucket of the series (s)")] = 60.0,
    top: Annotated[
        int, Query(ge=0, le=q.TOP_MAX, description="the worst engines right now drawn on their own")
    ] = q.TOP_DEFAULT,
    rank_by: Annotated[
        str, Query(pattern="^(" + "|".join(RANK_BY) + ")$", description="what makes an engine worse")
    ] = "kv_usage",
    source_id: Annotated[list[str] | None, Query(description="engines drawn on their own as well")] = None,
) -> Response:
    """The engines' steps per time bucket: by model, the ``top`` worst engines right now on their own
    (ranked by their newest bucket), the rest of each model as one series; every engine ranked."""
    w = _window(since, until)
    most = settings.attribution_max_buckets
    out = _read(
        reads,
        q.engine_load,
        w,
        bucket_s=bucket_s,
        top=top,
        rank_by=rank_by,
        source_ids=source_id or [],
        max_buckets=most,
    )
    return encoded(out)
