"""GET /v1/advice/chunk-size: engine settings for an ITL target, from the fitted step time."""

from __future__ import annotations

import importlib
from typing import Annotated

from fastapi import APIRouter, Depends, Response

from ledger.advice.answer import AdviceQuery, ChunkSizeAdvice
from ledger.advice.service import chunk_size_advice
from ledger.api import errors
from ledger.api.answers import documents, encoded
from ledger.api.deps import ReadsDep, StoreDep, require
from ledger.api.queries import query_dependency

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


@router.get("/advice/chunk-size", **documents(ChunkSizeAdvice, 404, 409, 422))
def chunk_size(
    store: StoreDep, reads: ReadsDep, query: Annotated[AdviceQuery, Depends(query_dependency(AdviceQuery))]
) -> Response:
    if store.dialect == "null":
        return errors.error_response(
            409, "this ledger stores nothing (null://): no steps to fit", reason="too_little_data"
        )
    assert reads.engine is not None
    with reads.budget_errors():  # an AdviceError (a Refusal) is answered by ledger.api.errors
        advice = chunk_size_advice(reads.engine, query)
    _publish(advice.window.model, advice.prefill_tokens_per_step)
    return encoded(advice)
