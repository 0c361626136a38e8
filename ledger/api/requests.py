"""Per-request ledger rows and their event timelines."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Path, status

from ledger.api.deps import StoreDep, require

router = APIRouter(dependencies=[require("read")])


@router.get("/v1/requests/{request_id}")
def get_request(store: StoreDep, request_id: str = Path(min_length=1, max_length=256)) -> dict[str, Any]:
    row = store.get_request(request_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no request {request_id!r} in the ledger")
    return {"request": row, "events": store.request_events(request_id)}


@router.get("/v1/sources")
def list_sources(store: StoreDep) -> dict[str, Any]:
    return {"sources": store.source_rows()}
