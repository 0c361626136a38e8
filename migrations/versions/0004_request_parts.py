"""request_parts: partial request rows appended by the write path, merged into request_rows later.

The embedded DuckDB backend spent most of its write time merging each group's partial rows into
``request_rows`` (an ON CONFLICT upsert: 13 ms per 4,000-event group, a third of the group), while
appending the same rows to a table without a key costs 3 ms. So the DuckDB write path appends partial
rows to ``request_parts`` and compacts them into ``request_rows`` every few seconds (one upsert of one
merged row per request instead of one per group it appeared in). PostgreSQL keeps merging directly (its
upsert is 4 ms per group) and leaves this table empty.

The ``requests`` view merges both, so every read sees the fold of every committed event whether or not
it was compacted yet: rows without parts as they are, rows with parts merged with them by each column's
aggregate (min, max or sum, as in ledger.fold). The column list and aggregates are frozen here; a later
migration that changes ``request_rows`` must change ``request_parts`` alike and re-create the view.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

from ledger.migrate import revision_module

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# request_rows' columns after 0002, in table order: name -> (aggregate, type).
_COLUMNS: dict[str, tuple[str, str]] = {
    "model": ("max", "text"),
    "engine_source_id": ("max", "text"),
    "gateway_source_id": ("max", "text"),
    "arrived_ts": ("min", "double"),
    "admission_enqueued_ts": ("min", "double"),
    "admitted_ts": ("min", "double"),
    "engine_arrival_ts": ("min", "double"),
    "queued_ts": ("min", "double"),
    "first_scheduled_ts": ("min", "double"),
    "first_token_ts": ("min", "double"),
    "last_token_ts": ("max", "double"),
    "finished_ts": ("min", "double"),
    "first_byte_ts": ("min", "double"),
    "completed_ts": ("min", "double"),
    "disconnected_ts": ("min", "double"),
    "stream_cut_ts": ("min", "double"),
    "last_event_ts": ("max", "double"),
    "entry_measured_s": ("sum", "double"),
    "admission_wait_s": ("sum", "double"),
    "backend_wait_measured_s": ("sum", "double"),
    "prompt_tokens": ("max", "bigint"),
    "max_tokens": ("max", "bigint"),
    "cached_tokens": ("sum", "bigint"),
    "prefill_computed_tokens": ("sum", "bigint"),
    "recomputed_tokens": ("sum", "bigint"),
    "output_tokens": ("max", "bigint"),
    "chunks": ("sum", "bigint"),
    "preemptions": ("sum", "bigint"),
    "resumes": ("sum", "bigint"),
    "kv_blocks_max": ("max", "bigint"),
    "token_events": ("sum", "bigint"),
    "events": ("sum", "bigint"),
    "finish_reason": ("max", "text"),
    "stop_reason": ("max", "text"),
    "status_code": ("max", "bigint"),
    "cut_rule": ("max", "text"),
    "requeue_wait_prefill_s": ("sum", "double"),
    "requeue_wait_decode_s": ("sum", "double"),
    "final_wait_s": ("sum", "double"),
    "step_count": ("sum", "bigint"),
    "active_s": ("sum", "double"),
    "last_step_ts": ("max", "double"),
    "stalled_steps": ("sum", "bigint"),
    "kv_idle_s": ("sum", "double"),
    "kv_idle_block_s": ("sum", "double"),
}
_TYPES = {"text": sa.Text, "double": sa.Double, "bigint": sa.BigInteger}


def _aggregate(col: str) -> str:
    agg, type_ = _COLUMNS[col]
    # sum(bigint) widens (numeric on PostgreSQL, hugeint on DuckDB): keep the column's type.
    return f"CAST(sum({col}) AS BIGINT)" if agg == "sum" and type_ == "bigint" else f"{agg}({col})"


_COLS = ", ".join(["request_id", *_COLUMNS])
# One merged row per request from rows with request_parts' columns (GROUP BY request_id).
_AGGS = ", ".join(["request_id", *(f"{_aggregate(c)} AS {c}" for c in _COLUMNS)])


def _merged_rows(aggs: str = _AGGS, cols: str = _COLS) -> str:
    """request_rows with request_parts folded in, as a subquery with request_rows' columns; ``aggs``:
    the merged row's select list (0005 passes saturating sums), ``cols``: the tables' columns (0006
    adds some)."""
    has_parts = "EXISTS (SELECT 1 FROM request_parts p WHERE p.request_id = q.request_id)"
    return (
        f"(SELECT {cols} FROM request_rows q WHERE NOT {has_parts} "
        f"UNION ALL SELECT {aggs} FROM ("
        f"SELECT {cols} FROM request_rows q WHERE {has_parts} "
        f"UNION ALL SELECT {cols} FROM request_parts) u GROUP BY request_id)"
    )


def _view_sql(rows: str) -> str:
    # The attribution columns are 0002's, over another row source.
    return revision_module("0002_attribution")._view_sql(rows)


def upgrade() -> None:
    op.create_table(
        "request_parts",
        sa.Column("request_id", sa.Text(), nullable=False),
        *(
            sa.Column(
                name,
                _TYPES[type_](),
                nullable=agg != "sum",
                server_default=sa.text("0") if agg == "sum" else None,
            )
            for name, (agg, type_) in _COLUMNS.items()
        ),
    )
    op.execute("DROP VIEW requests")
    op.execute(_view_sql(_merged_rows()))


def downgrade() -> None:
    # Fold what is not compacted yet into request_rows first: nothing accepted is lost.
    sets = []
    for col, (agg, _) in _COLUMNS.items():
        if agg == "sum":
            sets.append(f"{col} = request_rows.{col} + excluded.{col}")
        else:
            fn = "LEAST" if agg == "min" else "GREATEST"
            sets.append(f"{col} = {fn}(request_rows.{col}, excluded.{col})")
    op.execute(
        f"INSERT INTO request_rows ({_COLS}) SELECT {_AGGS} FROM request_parts GROUP BY request_id "
        f"ON CONFLICT (request_id) DO UPDATE SET {', '.join(sets)}"
    )
    op.execute("DROP VIEW requests")
    op.drop_table("request_parts")
    op.execute(_view_sql("request_rows"))
