"""What the analytics queries share: the tables, the tails asked for, the window filter, and reads of one
request's row, events and steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
import sqlalchemy as sa

from ledger import schema
from ledger.analytics.window import Window

R = schema.requests
S = schema.steps
E = schema.events


QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
MAX_PAGE = 1000


class QueryError(ValueError):
    """A query parameter that cannot be honoured; ``field`` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def in_window(stmt: sa.Select[Any], w: Window, col: sa.ColumnElement[Any]) -> sa.Select[Any]:
    if w.since is not None:
        stmt = stmt.where(col >= w.since)
    if w.until is not None:
        stmt = stmt.where(col < w.until)
    return stmt


def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (what percentile_cont computes)."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def request_row(conn: sa.Connection, request_id: str) -> dict[str, Any] | None:
    row = conn.execute(sa.select(R).where(R.c.request_id == request_id)).mappings().first()
    return dict(row) if row is not None else None


def event_data(conn: sa.Connection, request_id: str, kinds: Sequence[str]) -> list[dict[str, Any]]:
    rows = conn.execute(
        sa.select(E.c.source_id, E.c.ts, E.c.kind, E.c.data)
        .where(E.c.request_id == request_id, E.c.kind.in_(kinds))
        .order_by(E.c.ts, E.c.seq)
    ).all()
    out = []
    for source_id, ts, kind, data in rows:
        d = msgspec.json.decode(data) if data else {}
        d.update(source_id=source_id, ts=ts, kind=kind)
        out.append(d)
    return out


def engine_steps(
    conn: sa.Connection, source_id: str, lo: float, hi: float, *cols: sa.ColumnElement[Any]
) -> list[Any]:
    return list(
        conn.execute(
            sa.select(*cols).where(S.c.source_id == source_id, S.c.ts >= lo, S.c.ts <= hi).order_by(S.c.step)
        ).all()
    )
