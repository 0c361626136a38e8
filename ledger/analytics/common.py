"""What the analytics queries share: the tables, the tails asked for, the window filter, and reads of one
request's row, events and steps."""

from __future__ import annotations

import math
import types
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import sqlalchemy as sa

from ledger import schema
from ledger.analytics.window import Window
from ledger.rows import RequestRow

R = schema.requests
S = schema.steps
E = schema.events
K = schema.request_keys


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


def request_row(conn: sa.Connection, request_id: str) -> RequestRow | None:
    """The request's row of the ``requests`` view."""
    row = conn.execute(sa.select(R).where(R.c.request_id == request_id)).mappings().first()
    return RequestRow(**row) if row is not None else None


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
    """The source's steps in [lo, hi] by step number; ``request_keys`` among ``cols`` comes back as
    ``request_ids`` (``steps_with_ids``)."""
    stmt = sa.select(*cols).where(S.c.source_id == source_id, S.c.ts >= lo, S.c.ts <= hi).order_by(S.c.step)
    if any(c is S.c.request_keys for c in cols):
        return steps_with_ids(conn, stmt)
    return list(conn.execute(stmt).all())


# No step of a source starts more than this before the next (ledger.store.step_memory.MAX_STEP_GAP_S:
# the store links no steps further apart), so none lasts longer either.
MAX_STEP_S = 600.0


def started_by(conn: sa.Connection, source_id: str, at: float) -> float:
    """Start of the source's newest step that ended at or before ``at`` (``at - MAX_STEP_S`` when
    none): every step of it still running at ``at`` started later. A source's steps run one after the
    other, so their ends come in the order of their starts, even where the scheduling of the next
    overlaps the run of the previous (async scheduling: a step can start before the one before it ends,
    so the newest step begun by ``at`` is not a bound).

    So the steps overlapping a span can be read by a ``ts`` range DuckDB's zone maps prune. With
    ``ts + duration_s > lo`` alone the scan starts at the table's first row: for a request late in an
    hour of 236 engines, billions of list entries read (seconds) for a few steps."""
    found = conn.execute(
        sa.select(sa.func.max(S.c.ts)).where(
            S.c.source_id == source_id,
            S.c.ts <= at,
            S.c.ts >= at - MAX_STEP_S,
            S.c.ts + S.c.duration_s <= at,
        )
    ).scalar()
    return float(found) if found is not None else at - MAX_STEP_S


def request_key_of(request_id: str) -> sa.ScalarSelect[Any]:
    """The key steps store for ``request_id`` (NULL when no step named it), as a scalar subquery."""
    return sa.select(K.c.request_key).where(K.c.request_id == request_id).scalar_subquery()


def ran_in_step(request_id: str) -> sa.ColumnElement[bool]:
    """Whether a ``steps`` row ran ``request_id`` (its key is in ``request_keys``).

    ``array_position(...) IS NOT NULL``, not ``key = ANY(request_keys)``: DuckDB runs ANY over a list
    as a subquery per row, 4x slower over one engine's steps of a 236-engine fleet (2.5 against 0.6 s
    for a 13-minute request, whose time is then all in reading the steps' lists: docs/benchmarks.md,
    "Reads over an hour of a fleet"); PostgreSQL has the same function."""
    return sa.func.array_position(S.c.request_keys, request_key_of(request_id)).is_not(None)


def request_names(conn: sa.Connection, keys: Iterable[int]) -> dict[int, str]:
    """key -> request id for ``keys`` (the range bound lets DuckDB's zone maps skip the rest)."""
    wanted = sorted(set(keys))
    if not wanted:
        return {}
    rows = conn.execute(
        sa.select(K.c.request_key, K.c.request_id).where(
            K.c.request_key.between(wanted[0], wanted[-1]), K.c.request_key.in_(wanted)
        )
    ).all()
    return {key: rid for key, rid in rows}


def steps_with_ids(conn: sa.Connection, stmt: sa.Select[Any]) -> list[Any]:
    """Step rows of ``stmt`` (which selects ``request_keys``) with ``request_ids`` in its place: the
    requests' ids in the engine's order."""
    rows = [r._asdict() for r in conn.execute(stmt)]
    names = request_names(conn, (k for r in rows for k in r["request_keys"]))
    for r in rows:
        r["request_ids"] = [names[k] for k in r.pop("request_keys")]
    return [types.SimpleNamespace(**r) for r in rows]
