"""POST /v1/events: the ingest endpoint sources call."""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass

import msgspec
from fastapi import APIRouter, Request, Response, status
from starlette.requests import ClientDisconnect

from engine_hooks import events as ev
from ledger import intake
from ledger.api import errors
from ledger.api.answers import documents, encoded
from ledger.api.deps import ProducersDep, SettingsDep, WriterDep, on_ingest_pool, require
from ledger.api.models import BatchRejected
from ledger.columnar import Columns
from ledger.ingest import WriterUnavailable
from ledger.producers import ProducerReleased, digest
from ledger.ratelimit import Refusal, SourceLimits, peek_source_id
from ledger.store import WriteResult
from ledger.validation import BadBatch

router = APIRouter(prefix="/v1", tags=["ingest"])
log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode
_DECODE_INLINE_BYTES = 1 << 20  # larger bodies are decoded off the event loop


@dataclass
class _Body:
    data: bytes | None  # None: larger than the limit
    source_id: str | None = None  # the source id read from its first bytes and admitted by the limits
    refusal: Refusal | None = None  # the source is over an ingest limit: the rest was not read

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else 0


async def _read_body(request: Request, limit: int, limits: SourceLimits) -> _Body:
    """The body, or no data when it is larger than ``limit`` (checked before and while reading). The
    source's ingest limits are checked on its first bytes (``ledger.ratelimit``): a source over them
    gets its refusal before the rest is read, and an admitted one is charged the declared length."""
    length = request.headers.get("content-length")
    declared = int(length) if length is not None and length.isdigit() else None
    if declared is not None and declared > limit:
        return _Body(None)
    chunks: list[bytes] = []
    size = 0
    peeked = None
    async for chunk in request.stream():
        if not chunks and limits.enabled and chunk:
            peeked = peek_source_id(chunk)
            if peeked is not None:
                refusal = limits.admit(peeked, declared or 0)
                if refusal is not None:
                    return _Body(None, peeked, refusal)
        size += len(chunk)
        if size > limit:
            return _Body(None)
        chunks.append(chunk)
    data = b"".join(chunks)
    if peeked is not None and declared is None:
        limits.charge_bytes(peeked, len(data))
    return _Body(data, peeked)


def _rate_limited(request: Request, source_id: str, refusal: Refusal) -> Response:
    """429 naming the limit the source is over; ``Retry-After`` is when its bucket is paid back."""
    _count_rejection(request, "rate_limited")
    wait = max(1, math.ceil(refusal.retry_after_s))
    return errors.error_response(
        status.HTTP_429_TOO_MANY_REQUESTS,
        f"source.id: {source_id!r} sent more than its {refusal.limit} ({refusal.rate:g} {refusal.unit} per "
        f"second, CHUNKLEDGER_{refusal.limit.upper()}); nothing stored, retry after {wait} s",
        reason="rate_limited",
        headers={"Retry-After": str(wait)},
        limit=refusal.limit,
    )


def _conflict(request: Request, source_id: str, result: WriteResult) -> Response:
    """409: the batch sent other events under seqs already stored; those are not replaced."""
    seqs = result.conflicts
    _count_rejection(request, "conflicting_replay")
    named = ", ".join(map(str, seqs[:10])) + (f" and {len(seqs) - 10} more" if len(seqs) > 10 else "")
    log.warning(
        "conflicting replay from source %s: seq %s already stored with other content", source_id, named
    )
    return errors.error_response(
        status.HTTP_409_CONFLICT,
        f"seq {named}: source {source_id!r} already stored other events under these seqs; they are not "
        f"replaced (the batch's other {result.accepted} new events were stored)",
        reason="conflicting_replay",
        seqs=seqs[:1000],
        accepted=result.accepted,
        duplicates=result.duplicates,
    )


def _not_owner(request: Request, source_id: str, result: WriteResult) -> Response:
    """409: the batch named requests another source of its kind serves (``ledger.store.request_owners``);
    its events about them were refused."""
    ids = result.foreign
    _count_rejection(request, "not_request_owner")
    named = ", ".join(map(repr, ids[:10])) + (f" and {len(ids) - 10} more" if len(ids) > 10 else "")
    log.warning("source %s sent events about requests another source serves: %s", source_id, named)
    return errors.error_response(
        status.HTTP_409_CONFLICT,
        f"request_id {named}: served by another source; source {source_id!r}'s events about them were "
        f"refused, not stored (the batch's other {result.accepted} new events were stored)",
        reason="not_request_owner",
        request_ids=ids[:1000],
        accepted=result.accepted,
        duplicates=result.duplicates,
    )


# The body is decoded with msgspec (the wire contract), not by FastAPI: ``ledger.api.openapi`` names its
# schema (Batch) and the 200 answer's (IngestResponse). Nothing here is validated by pydantic.
@router.post(
    "/events",
    dependencies=[require("ingest")],
    response_model=None,
    responses=errors.responses(
        400, *errors.AUTH, 408, 409, 413, 415, 422, 429, 503, models={422: BatchRejected}
    ),
)
async def ingest_events(
    request: Request, settings: SettingsDep, writer: WriterDep, producers: ProducersDep
) -> Response:
    """Store a batch of events (ingest token); the answer carries the source's pending commands.

    In order: read the body within the source's limits, decode it, fence it to the source's producer,
    show it to the rule engine, store it, answer with the source's commands."""
    try:
        read = await _read_body(request, settings.max_body_bytes, request.app.state.source_limits)
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
    decoded = await _decode(request, settings, read)
    if isinstance(decoded, Response):
        return decoded
    batch, columns = decoded
    producer = digest(request.headers.get(ev.PRODUCER_HEADER))
    fenced = await _fence(request, producers, batch.source.id, producer)
    if fenced is not None:
        return fenced
    try:
        result = await intake.store(request.app.state, batch, columns, producer, read.size, received)
    except WriterUnavailable as exc:
        _count_rejection(request, "unavailable")
        return errors.error_response(
            status.HTTP_503_SERVICE_UNAVAILABLE,
            f"not stored, retry: {exc}",
            reason="unavailable",
            headers={"Retry-After": "1"},
        )
    if result.conflicts:
        return _conflict(request, batch.source.id, result)
    if result.foreign:
        return _not_owner(request, batch.source.id, result)
    return await _accepted(request, batch.source.id, result)


def _count_rejection(request: Request, reason: str) -> None:
    runaway = getattr(request.app.state, "runaway", None)
    if runaway is not None:
        runaway.metrics.ingest_rejections.labels(reason).inc()


async def _decode(
    request: Request, settings: SettingsDep, read: _Body
) -> tuple[ev.Batch, Columns | None] | Response:
    """The batch (and its columns) of a body read within the limits, admitted and charged to its
    source, its times from the future clamped; or the refusal's answer."""
    limits: SourceLimits = request.app.state.source_limits
    if read.refusal is not None and read.source_id is not None:
        return _rate_limited(request, read.source_id, read.refusal)
    body = read.data
    if body is None:
        _count_rejection(request, "too_large")
        return errors.error_response(
            status.HTTP_413_CONTENT_TOO_LARGE,
            f"body larger than {settings.max_body_bytes} bytes; send smaller batches",
            reason="too_large",
        )
    try:
        decode = functools.partial(
            intake.decode,
            content_type=request.headers.get("content-type"),
            max_events=settings.max_events_per_batch,
        )
        if len(body) > _DECODE_INLINE_BYTES:
            # A large body decodes on a worker thread: the event loop keeps answering other sources
            # meanwhile (the interpreter switches threads every few ms) instead of stopping for it.
            batch, columns = await on_ingest_pool(request, decode, body)
        else:
            batch, columns = decode(body)
    except BadBatch as exc:
        _count_rejection(request, "invalid")
        return errors.error_response(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            "batch rejected, nothing stored",
            reason="invalid",
            errors=[e.as_dict() for e in exc.errors],
        )
    if read.source_id != batch.source.id:  # not found in its first bytes: admitted now
        refusal = limits.admit(batch.source.id, len(body))
        if refusal is not None:
            return _rate_limited(request, batch.source.id, refusal)
    limits.charge_events(batch.source.id, len(batch.events))
    return batch, intake.clamp_clock(batch, columns, settings, request.app.state.metrics)


async def _fence(
    request: Request, producers: ProducersDep, sid: str, producer: str | None
) -> Response | None:
    """409 unless ``producer`` may send as source ``sid`` (``ledger.producers``): checked before the
    rule engine sees anything of the batch."""
    if producers.current(sid, producer):
        return None
    left = await on_ingest_pool(request, producers.claim, sid, producer)
    if left is None:
        return None
    _count_rejection(request, "fenced")
    log.info("fenced a batch for source %s: another producer owns it", sid)
    return errors.error_response(
        status.HTTP_409_CONFLICT,
        f"source.id: {sid!r} is bound to another producer (the key in the {ev.PRODUCER_HEADER} "
        f"header); nothing stored. Retry after {math.ceil(left)} s, when that binding lapses if "
        "its producer stopped",
        reason="fenced",
        headers={"Retry-After": str(math.ceil(left))},
    )


async def _accepted(request: Request, sid: str, result: WriteResult) -> Response:
    """200 with the counts and the commands pending for the source, re-sent in every answer until the
    source confirms them (``ledger.rules.commands``)."""
    runaway = getattr(request.app.state, "runaway", None)
    commands: list[ev.Command] = []
    if runaway is not None and runaway.book.has_pending(sid):
        commands = runaway.book.for_source(sid)
        await on_ingest_pool(request, runaway.book.mark_delivered, sid, commands, "ingest")
    answer = ev.IngestResponse(accepted=result.accepted, duplicates=result.duplicates, commands=commands)
    return Response(_encode(answer), media_type="application/json")


@router.delete(
    "/sources/{source_id}/producer",
    dependencies=[require("ingest")],
    **documents(ProducerReleased, 409, 422),
)
async def release_producer(request: Request, producers: ProducersDep, source_id: str) -> Response:
    """A producer stopping for good with nothing left to send releases its source id (ingest token and
    its key in the producer header), so that its successor need not wait out the lease
    (``ledger.producers``); 409 when another producer holds it."""
    producer = digest(request.headers.get(ev.PRODUCER_HEADER))
    if producer is None or not 0 < len(source_id) <= 128:
        raise errors.ApiError(
            422,
            f"{ev.PRODUCER_HEADER}: the producer's key is required to release its source id"
            if producer is None
            else "source_id: 1 to 128 characters",
            reason="invalid",
        )
    released = await on_ingest_pool(request, producers.release, source_id, producer)
    if released is None:
        raise errors.ApiError(
            409,
            f"source_id: {source_id!r} is bound to another producer; only its own may release it",
            reason="not_source_owner",
        )
    return encoded(ProducerReleased(source_id=source_id, released=released))
