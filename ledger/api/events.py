"""POST /v1/events: the ingest endpoint sources call."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request, Response, status
from fastapi.responses import JSONResponse

from engine_hooks import events as ev
from ledger.api.deps import SettingsDep, WriterDep, require
from ledger.ingest import BadBatch, WriterUnavailable, decode_batch

router = APIRouter()
_encode = msgspec.json.Encoder().encode


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None when it is larger than ``limit`` (checked before and while reading)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        return None
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


@router.post("/v1/events", dependencies=[require("ingest")])
async def ingest_events(request: Request, settings: SettingsDep, writer: WriterDep) -> Response:
    body = await _read_body(request, settings.max_body_bytes)
    if body is None:
        return JSONResponse(
            {"detail": f"body larger than {settings.max_body_bytes} bytes; send smaller batches"},
            status_code=status.HTTP_413_CONTENT_TOO_LARGE,
        )
    try:
        batch = decode_batch(body, max_events=settings.max_events_per_batch)
    except BadBatch as exc:
        return JSONResponse(
            {"detail": "batch rejected, nothing stored", "errors": [e.as_dict() for e in exc.errors]},
            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
        )
    try:
        result = await writer.submit(batch)
    except WriterUnavailable as exc:
        return JSONResponse(
            {"detail": f"not stored, retry: {exc}"},
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": "1"},
        )
    answer = ev.IngestResponse(accepted=result.accepted, duplicates=result.duplicates, commands=[])
    return Response(_encode(answer), media_type="application/json")
