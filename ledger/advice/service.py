"""``chunk_size_advice``: read a window's steps, fit step time, advise settings for an ITL target."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from ledger.advice.advisor import AdviceError, Advisor
from ledger.advice.defaults import DEFAULT_ARRIVAL_SHARE, DEFAULT_MAX_STEPS, MIN_USEFUL_CHUNK
from ledger.advice.fit import FitError
from ledger.advice.query import read_steps


def chunk_size_advice(
    engine: sa.Engine,
    *,
    itl_target_ms: float,
    model: str | None = None,
    source_id: str | None = None,
    since: str | float | None = None,
    until: str | float | None = None,
    depth: int | None = None,
    arrival_share: float = DEFAULT_ARRIVAL_SHARE,
    max_steps: int = DEFAULT_MAX_STEPS,
    min_chunk: int = MIN_USEFUL_CHUNK,
) -> dict[str, Any]:
    """Advice for ``itl_target_ms`` from the ledger's steps; AdviceError (with an HTTP status) if none."""
    window = read_steps(
        engine, model=model, source_id=source_id, since=since, until=until, max_steps=max_steps
    )
    try:
        advisor = Advisor(window.data)
    except FitError as exc:
        raise AdviceError(exc.reason, str(exc), status=409, window=window.as_dict(), **exc.details) from None
    try:
        advice = advisor.advise(itl_target_ms, depth=depth, arrival_share=arrival_share, min_chunk=min_chunk)
    except AdviceError as exc:
        exc.details["window"] = window.as_dict()
        raise
    return {"window": window.as_dict(), **advice}
