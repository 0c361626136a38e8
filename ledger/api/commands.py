"""GET /v1/commands (long-poll, ingest token) and GET /v1/cutoffs (the decisions, read token)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from engine_hooks import events as ev
from ledger.api import errors
from ledger.api.answers import documents, encoded
from ledger.api.deps import on_ingest_pool, require
from ledger.api.policy import runaway
from ledger.producers import ProducerBook, digest
from ledger.rows import Cutoffs

router = APIRouter(prefix="/v1", tags=["rules"])
_encode = msgspec.json.Encoder().encode


# The answer is the wire contract's CommandsResponse (msgspec): ``ledger.api.openapi`` names its schema.
@router.get(
    "/commands",
    dependencies=[require("ingest")],
    response_model=None,
    responses=errors.responses(*errors.AUTH, 422),
)
async def get_commands(
    request: Request,
    source_id: Annotated[str, Query(min_length=1, max_length=128, description="the source asking")],
    wait_s: Annotated[float, Query(ge=0, le=60, description="wait up to this long for a command")] = 0.0,
) -> Response:
    """The source's unconfirmed commands (``{"commands": [...]}``); re-sent until confirmed. Only the
    source's producer may read them: with its key when the source is bound to one (``ledger.producers``)."""
    producer = digest(request.headers.get(ev.PRODUCER_HEADER))
    producers: ProducerBook = request.app.state.producers
    if not producers.current(source_id, producer) and not await on_ingest_pool(
        request, producers.owns, source_id, producer
    ):
        raise errors.ApiError(
            403,
            f"source_id: {source_id!r} is bound to another producer; only its own producer (its key in "
            f"the {ev.PRODUCER_HEADER} header) may read its commands",
            reason="not_source_owner",
        )
    book = runaway(request).book
    commands = await book.wait(source_id, wait_s)
    if commands:
        await on_ingest_pool(request, book.mark_delivered, source_id, commands, "poll")
    return Response(_encode({"commands": commands}), media_type="application/json")


@router.get(
    "/cutoffs",
    dependencies=[require("read")],
    **documents(Cutoffs, 422),
)
async def get_cutoffs(
    request: Request,
    request_id: Annotated[str | None, Query(max_length=256)] = None,
    state: Annotated[Literal["pending", "applied", "moot", "expired"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> Response:
    """Stored decisions, newest first, with their delivery and confirmation times."""
    rows = await run_in_threadpool(
        runaway(request).book.rows, request_id=request_id, state=state, limit=limit
    )
    return encoded(Cutoffs(cutoffs=rows))
