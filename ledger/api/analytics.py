"""Read-only analytics endpoints (read token): attribution, request lists, ITL, why, KV stalls.

Every handler is a thin wrapper over a named query in ``ledger.analytics.queries``; parameter errors
answer 422 naming the field, like the ingest endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, HTTPException, Path, Query, status

from ledger.analytics import queries as q
from ledger.analytics.window import BadTime, Window
from ledger.api.deps import StoreDep, require

router = APIRouter(dependencies=[require("read")])

T = TypeVar("T")
Since = Annotated[str | None, Query(description="unix seconds, ISO 8601, or an age like 15m / 2h / 1d")]
Until = Annotated[str | None, Query(description="same forms as since; default now")]
RequestId = Annotated[str, Path(min_length=1, max_length=256)]


def _bad(field: str, reason: str) -> HTTPException:
    return HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail=f"{field}: {reason}")


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


def _read(store: Any, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    with _params(), store.engine.connect() as conn:
        return fn(conn, *args, **kw)


@router.get("/v1/attribution")
def attribution(
    store: StoreDep,
    since: Since = None,
    until: Until = None,
    group_by: Annotated[str, Query(description="comma-separated: " + ", ".join(q.GROUPS))] = "",
    bucket_s: Annotated[float | None, Query(gt=0, description="also bucket by end time")] = None,
) -> dict[str, Any]:
    """Per-layer tails (count, p50, p90, p99, max, mean) of finished requests, by end time, with the
    decode inter-token latency of the same window."""
    w = _window(since, until)
    groups = [g.strip() for g in group_by.split(",") if g.strip()]
    rows = _read(store, q.attribution, w, group_by=groups, bucket_s=bucket_s)
    itl = _read(store, q.decode_itl, w, group_by_model="model" in groups)
    return {"since": w.since, "until": w.until, "group_by": groups, "groups": rows, "itl": itl}


@router.get("/v1/requests")
def list_requests(
    store: StoreDep,
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
) -> dict[str, Any]:
    """Requests whose start falls in the window, filtered and sorted by any column, a page at a time."""
    return _read(
        store,
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


@router.get("/v1/itl")
def itl(store: StoreDep, since: Since = None, until: Until = None, by_model: bool = False) -> dict[str, Any]:
    """Decode inter-token latency tails over the window, from the engines' steps."""
    w = _window(since, until)
    return {"since": w.since, "until": w.until, "itl": _read(store, q.decode_itl, w, group_by_model=by_model)}


@router.get("/v1/requests/{request_id}/itl")
def request_itl(store: StoreDep, request_id: RequestId) -> dict[str, Any]:
    """One request's inter-token gaps and their tails."""
    out = _read(store, q.request_itl, request_id)
    if out is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no request {request_id!r} in the ledger")
    return out


@router.get("/v1/requests/{request_id}/why")
def why(
    store: StoreDep, request_id: RequestId, top: Annotated[int, Query(ge=1, le=50)] = 5
) -> dict[str, Any]:
    """What delayed the request, biggest first, with the requests behind each delay."""
    out = _read(store, q.why, request_id, top=top)
    if out is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no request {request_id!r} in the ledger")
    return out


@router.get("/v1/kv/stalls")
def kv_stalls(
    store: StoreDep,
    limit: Annotated[int, Query(ge=1, le=q.MAX_PAGE)] = 50,
    horizon_s: Annotated[float, Query(gt=0)] = 3600.0,
) -> dict[str, Any]:
    """Live requests ranked by seconds without progress (KV held idle, or waiting to start)."""
    now = time.time()
    return {"now": now, "requests": _read(store, q.kv_stalls, now, limit=limit, horizon_s=horizon_s)}
