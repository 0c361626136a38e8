"""Taking a batch in, whatever carried it: ``POST /v1/events`` (``ledger.api.events``) and the JetStream
workers (``ledger.streams``) both decode a body here, clamp its clock, show it to the rule engine and
store it.

A body is JSON (the contract, ``engine_hooks.events.Batch``) or the columnar message
(``engine_hooks.columnar``), told apart by its media type. The rule engine sees the batch beside the
store's write, so cutoffs never wait for a commit; the events the rule engine skipped as at or below
the source's mark are shown to it once the store has said they were new.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from engine_hooks import events as ev
from engine_hooks.columnar import MEDIA_TYPE
from ledger.columnar import Columns, decode_columns
from ledger.config import Settings
from ledger.metrics import LedgerMetrics
from ledger.store import WriteResult
from ledger.validation import clamp_future, decode_batch

log = logging.getLogger(__name__)


def media_type(content_type: str | None) -> str:
    """The media type of a ``Content-Type``, without its parameters, in lower case."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def decode(body: bytes, content_type: str | None, max_events: int) -> tuple[ev.Batch, Columns | None]:
    """The batch of a body, and its columns when it came as the columnar message; raises
    ``ledger.validation.BadBatch`` naming what is wrong."""
    if media_type(content_type) == MEDIA_TYPE:
        columns = decode_columns(body, max_events=max_events)
        return columns.batch(), columns
    return decode_batch(body, max_events=max_events), None


def clamp_clock(
    batch: ev.Batch, columns: Columns | None, settings: Settings, metrics: LedgerMetrics
) -> Columns | None:
    """Events stamped further ahead of the ledger's clock than ``max_clock_ahead_s`` take the receive
    time (counted, logged); then the events, not the columns as sent, are what is folded."""
    ahead = clamp_future(batch, time.time(), settings.max_clock_ahead_s)
    if not ahead:
        return columns
    log.warning(
        "%d events from %s were stamped over %.0f s ahead of the ledger's clock; stored with the "
        "receive time",
        ahead,
        batch.source.id,
        settings.max_clock_ahead_s,
    )
    metrics.ingest_future_timestamps.labels(metrics.sources(batch.source.id)).inc(ahead)
    return None


async def store(
    state: Any,
    batch: ev.Batch,
    columns: Columns | None,
    producer: str | None,
    nbytes: int,
    received: float,
) -> WriteResult:
    """Show the batch to the rule engine and store it (``state``: the app's, with ``writer`` and
    ``runaway``); the write's result once committed. Raises ``ledger.ingest.WriterUnavailable``."""
    runaway = getattr(state, "runaway", None)
    observed = runaway.observe_arrival(batch, received, columns) if runaway is not None else None
    result: WriteResult = await state.writer.submit(batch, producer, nbytes, columns)
    if observed is not None and runaway is not None:
        late = await asyncio.wrap_future(observed)
        if late and result.accepted and not result.duplicates and not result.conflicts:
            await asyncio.wrap_future(runaway.observe_late(batch, late))
    return result
