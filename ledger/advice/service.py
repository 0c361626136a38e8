"""``chunk_size_advice``: the advice for an :class:`~ledger.advice.answer.AdviceQuery`, in three named
stages that the API, the CLI (``--db``) and the bench share:

1. :func:`load_window`: the newest steps of one model (or source) in the window;
2. :func:`fit_cost`: the step-time fit on them (an :class:`Advisor`);
3. :func:`compute_settings`: the settings for the target, with the window they were fitted on.

Each stage's refusal is an :class:`AdviceError` (with its HTTP status), carrying the window once it is
known.
"""

from __future__ import annotations

import msgspec
import sqlalchemy as sa

from ledger.advice.advisor import AdviceError, Advisor
from ledger.advice.answer import AdviceQuery, ChunkSizeAdvice
from ledger.advice.fit import FitError
from ledger.advice.query import StepWindow, read_steps
from ledger.records import as_json


def chunk_size_advice(engine: sa.Engine, query: AdviceQuery) -> ChunkSizeAdvice:
    """Advice for ``query`` from the ledger's steps; AdviceError (with an HTTP status) if none."""
    window = load_window(engine, query)
    return compute_settings(fit_cost(window), window, query)


def load_window(engine: sa.Engine, query: AdviceQuery) -> StepWindow:
    return read_steps(
        engine,
        model=query.model,
        source_id=query.source_id,
        since=query.since,
        until=query.until,
        max_steps=query.max_steps,
    )


def fit_cost(window: StepWindow) -> Advisor:
    try:
        return Advisor(window.data)
    except FitError as exc:
        raise AdviceError(
            exc.reason, str(exc), status=409, window=as_json(window.summary()), **exc.details
        ) from None


def compute_settings(advisor: Advisor, window: StepWindow, query: AdviceQuery) -> ChunkSizeAdvice:
    try:
        advice = advisor.advise(query)
    except AdviceError as exc:
        exc.details["window"] = as_json(window.summary())
        raise
    return ChunkSizeAdvice(window=window.summary(), **msgspec.structs.asdict(advice))
