"""Live requests ranked by how long their KV has sat without a new token (``kv_stalls``)."""

from __future__ import annotations

import sqlalchemy as sa

from ledger.analytics.answers import KvStall
from ledger.analytics.common import (
    MAX_PAGE,
    QueryError,
    R,
)


def kv_stalls(
    conn: sa.Connection, now: float, *, limit: int = 50, horizon_s: float = 3600.0
) -> list[KvStall]:
    """Live requests ranked by how long they have gone without progress.

    Running requests (scheduled at least once) stall from their last step or token; waiting ones
    (queued, never scheduled) from when they were queued. Requests with no event for ``horizon_s``
    are left out (their engine is gone). ``kv_idle_s`` is the idle time already folded from steps.
    """
    if not 1 <= limit <= MAX_PAGE:
        raise QueryError("limit", f"must be between 1 and {MAX_PAGE}")
    since_progress = sa.func.coalesce(
        sa.func.greatest(R.c.last_step_ts, R.c.last_token_ts), R.c.first_scheduled_ts, R.c.queued_ts
    )
    # a source whose clock runs ahead of the ledger's stamps progress "in the future": no stall yet, not
    # a negative one
    stall = sa.func.greatest(sa.literal(0.0), sa.literal(now) - since_progress).label("stall_s")
    state = sa.case((R.c.first_scheduled_ts.is_(None), "waiting"), else_="running").label("state")
    stmt = (
        sa.select(
            R.c.request_id,
            R.c.model,
            R.c.engine_source_id,
            state,
            stall,
            R.c.kv_idle_s,
            R.c.kv_idle_block_s,
            R.c.kv_blocks_max,
            R.c.preemptions,
            R.c.output_tokens,
            R.c.prompt_tokens,
            R.c.queued_ts,
        )
        .where(R.c.end_ts.is_(None), R.c.queued_ts.is_not(None), R.c.last_event_ts >= now - horizon_s)
        .order_by(stall.desc(), R.c.request_id)
        .limit(limit)
    )
    return [KvStall(**r) for r in conn.execute(stmt).mappings()]
