"""GET /v1/advice/chunk-size: engine settings for an ITL target, from the fitted step time."""

from __future__ import annotations

import importlib
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from ledger.advice.defaults import DEFAULT_ARRIVAL_SHARE, DEFAULT_MAX_STEPS, MIN_USEFUL_CHUNK
from ledger.advice.service import chunk_size_advice
from ledger.api import errors
from ledger.api.deps import ReadsDep, StoreDep, require
from ledger.api.models import ChunkSizeAdvice

router = APIRouter(prefix="/v1", tags=["advice"], dependencies=[require("read")])


def _publish(model: str | None, tokens: int) -> None:
    """The advised prefill tokens per step as a Prometheus gauge, when the metrics module offers one."""
    try:
        metrics = importlib.import_module("ledger.metrics")
    except ImportError:
        return
    setter = getattr(metrics, "set_advised_chunk", None)
    if setter is not None:
        setter(model or "", tokens)


@router.get(
    "/advice/chunk-size",
    response_model=None,
    responses={200: {"model": ChunkSizeAdvice}, **errors.responses(*errors.AUTH, 404, 409, 422)},
)
def chunk_size(
    store: StoreDep,
    reads: ReadsDep,
    itl_target_ms: float = Query(gt=0, le=600_000, description="the inter-token latency p99 to stay within"),
    model: str | None = Query(None, min_length=1, max_length=256, description="served model (sources.model)"),
    source_id: str | None = Query(None, min_length=1, max_length=128, description="one engine source"),
    since: str | None = Query(None, max_length=64, description="unix seconds, ISO 8601, or an age: 15m, 2h"),
    until: str | None = Query(None, max_length=64),
    depth: int | None = Query(None, ge=0, description="advise at this prefill depth (default: p99 seen)"),
    arrival_share: float = Query(
        DEFAULT_ARRIVAL_SHARE, ge=0, lt=1, description="share of each step's prefill kept for arrivals"
    ),
    max_steps: int = Query(DEFAULT_MAX_STEPS, ge=100, le=1_000_000, description="newest steps to fit on"),
    min_chunk: int = Query(
        MIN_USEFUL_CHUNK,
        ge=1,
        le=1_000_000,
        description="refuse a target leaving fewer prefill tokens per step",
    ),
) -> dict[str, Any] | JSONResponse:
    if store.dialect == "null":
        return errors.error_response(
            409, "this ledger stores nothing (null://): no steps to fit", reason="too_little_data"
        )
    assert reads.engine is not None
    with reads.budget_errors():  # an AdviceError (a Refusal) is answered by ledger.api.errors
        advice = chunk_size_advice(
            reads.engine,
            itl_target_ms=itl_target_ms,
            model=model,
            source_id=source_id,
            since=since,
            until=until,
            depth=depth,
            arrival_share=arrival_share,
            max_steps=max_steps,
            min_chunk=min_chunk,
        )
    _publish(advice["window"]["model"], advice["prefill_tokens_per_step"])
    return advice
