"""Per-request ledger rows and their event timelines."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Path, Response, status

from ledger.api import errors
from ledger.api.answers import documents, encoded
from ledger.api.deps import ReadsDep, SettingsDep, StoreDep, require
from ledger.rows import EventRow, RequestDetail, RequestRow, SourceRow, Sources

router = APIRouter(prefix="/v1", tags=["requests"], dependencies=[require("read")])


@router.get("/requests/{request_id}", **documents(RequestDetail, 404, 422))
def get_request(
    store: StoreDep,
    reads: ReadsDep,
    settings: SettingsDep,
    request_id: str = Path(min_length=1, max_length=256),
) -> Response:
    """The request's row and every event of it, oldest first, and its trace UI link when
    ``CHUNKLEDGER_TRACE_URL`` is set (read token)."""
    with reads.connect() as conn:
        row = store.get_request(request_id, conn)
        if row is None:
            raise errors.ApiError(status.HTTP_404_NOT_FOUND, f"no request {request_id!r} in the ledger")
        events = msgspec.convert(store.request_events(request_id, conn), list[EventRow])
        link = settings.trace_link(row.get("trace_id"))
        return encoded(RequestDetail(request=RequestRow(**row), events=events, trace_url=link))


@router.get("/sources", **documents(Sources))
def list_sources(store: StoreDep, reads: ReadsDep) -> Response:
    """Every source that has sent events: its sequence high-water mark and counts (read token)."""
    with reads.connect() as conn:
        rows = store.source_rows(conn)
    return encoded(Sources(sources=[SourceRow(**r) for r in rows]))
