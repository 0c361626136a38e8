"""Per-request ledger rows and their event timelines."""

from __future__ import annotations

from fastapi import APIRouter, Path, Response, status

from ledger.api import errors
from ledger.api.deps import ReadsDep, StoreDep, require
from ledger.api.models import RequestDetail, Sources, json_response

router = APIRouter(prefix="/v1", tags=["requests"], dependencies=[require("read")])


@router.get(
    "/requests/{request_id}",
    response_model=None,
    responses={200: {"model": RequestDetail}, **errors.responses(*errors.AUTH, 404, 422)},
)
def get_request(
    store: StoreDep, reads: ReadsDep, request_id: str = Path(min_length=1, max_length=256)
) -> Response:
    """The request's row and every event of it, oldest first (read token)."""
    with reads.connect() as conn:
        row = store.get_request(request_id, conn)
        if row is None:
            raise errors.ApiError(status.HTTP_404_NOT_FOUND, f"no request {request_id!r} in the ledger")
        return json_response({"request": row, "events": store.request_events(request_id, conn)})


@router.get("/sources", response_model=Sources, responses=errors.responses(*errors.AUTH))
def list_sources(store: StoreDep, reads: ReadsDep) -> dict[str, object]:
    """Every source that has sent events: its sequence high-water mark and counts (read token)."""
    with reads.connect() as conn:
        return {"sources": store.source_rows(conn)}
