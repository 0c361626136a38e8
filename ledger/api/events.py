"""POST /v1/events: the ingest endpoint sources call."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from fastapi import APIRouter, Request, Response, status
from starlette.requests import ClientDisconnect

from engine_hooks import events as ev
from ledger.api import errors
from ledger.api.deps import SettingsDep, WriterDep, require
from ledger.api.models import BatchRejected
from ledger.ingest import BadBatch, WriterUnavailable, clamp_future, decode_batch

router = APIRouter(prefix="/v1", tags=["ingest"])
log = logging.getLogger(__name__)
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


# The body is decoded with msgspec (the wire contract), not by FastAPI: ``ledger.api.openapi`` names its
# schema (Batch) and the 200 answer's (IngestResponse). Nothing here is validated by pydantic.
@router.post(
    "/events",
    dependencies=[require("ingest")],
    response_model=None,
    responses=errors.responses(400, *errors.AUTH, 408, 413, 422, 503, models={422: BatchRejected}),
)
async def ingest_events(request: Request, settings: SettingsDep, writer: WriterDep) -> Response:
    """Store a batch of events (ingest token); the answer carries the source's pending commands."""
    try:
        body = await _read_body(request, settings.max_body_bytes)
    except ClientDisconnect:
        # The source gave up mid-upload (its timeout); nothing was stored, and it will send the batch
        # again. Not a server error: no traceback, and nobody is left to read an answer.
        log.info("a source disconnected while sending a batch; nothing stored")
        return errors.error_response(
            status.HTTP_400_BAD_REQUEST,
            "body: the client disconnected before sending all of it; nothing stored",
            reason="disconnected",
        )
    received = time.monotonic()
    runaway = getattr(request.app.state, "runaway", None)
    if body is None:
        if runaway is not None:
            runaway.metrics.ingest_rejections.labels("too_large").inc()
        return errors.error_response(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"body larger than {settings.max_body_bytes} bytes; send smaller batches",
            reason="too_large",
        )
    try:
        batch = decode_batch(body, max_events=settings.max_events_per_batch)
    except BadBatch as exc:
        if runaway is not None:
            runaway.metrics.ingest_rejections.labels("invalid").inc()
        return errors.error_response(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            "batch rejected, nothing stored",
            reason="invalid",
            errors=[e.as_dict() for e in exc.errors],
        )
    ahead = clamp_future(batch, time.time(), settings.max_clock_ahead_s)
    if ahead:
        log.warning(
            "%d events from %s were stamped over %.0f s ahead of the ledger's clock; stored with the "
            "receive time",
            ahead,
            batch.source.id,
            settings.max_clock_ahead_s,
        )
        request.app.state.metrics.ingest_future_timestamps.labels(batch.source.id).inc(ahead)
    # The rule engine sees the batch now, beside the store's write: cutoffs never wait for a commit.
    observed = runaway.observe_arrival(batch, received) if runaway is not None else None
    try:
        result = await writer.submit(batch)
    except WriterUnavailable as exc:
        if runaway is not None:
            runaway.metrics.ingest_rejections.labels("unavailable").inc()
        return errors.error_response(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"not stored, retry: {exc}",
            reason="unavailable",
            headers={"Retry-After": "1"},
        )
    if observed is not None and runaway is not None:
        late = await asyncio.wrap_future(observed)
        if late and result.accepted and not result.duplicates:
            await asyncio.wrap_future(runaway.observe_late(batch, late))
    commands: list[ev.Command] = []
    if runaway is not None and runaway.book.has_pending(batch.source.id):
        # Re-sent in every response until the source confirms (ledger.rules.commands).
        commands = runaway.book.for_source(batch.source.id)
        await asyncio.get_running_loop().run_in_executor(
            request.app.state.ingest_pool, runaway.book.mark_delivered, batch.source.id, commands, "ingest"
        )
    answer = ev.IngestResponse(accepted=result.accepted, duplicates=result.duplicates, commands=commands)
    return Response(_encode(answer), media_type="application/json")
