"""request_step_parts: the partial rows a group's steps fold into, in ten columns instead of 53.

The DuckDB write path folds a group's steps into one partial row per request (``ledger.fold.StepFold``)
that sets ten of ``request_rows``' columns. Appended to ``request_parts``, the other 43 were NULLs and
zeros that DuckDB writes to its WAL all the same: 9,000 rows cost 4.0 MB of WAL and 20 ms against
1.15 MB and 7 ms in ten columns, and they were most of a busy fleet's WAL. They go to this table; the
``requests`` view and DuckDB's compaction merge both tables. PostgreSQL merges at write and leaves it
empty, as it leaves ``request_parts``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

from ledger.migrate import revision_module

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_v4 = revision_module("0004_request_parts")
_v5 = revision_module("0005_saturating_sums")
_v6 = revision_module("0006_client_side")

# The columns a step folds into, as of this revision (``ledger.fold.STEP_FOLD_COLUMNS``).
STEP_COLUMNS = (
    "first_token_ts",
    "last_token_ts",
    "last_event_ts",
    "output_tokens",
    "step_count",
    "active_s",
    "last_step_ts",
    "stalled_steps",
    "kv_idle_s",
    "kv_idle_block_s",
)
_TYPES = {"double": sa.Double, "bigint": sa.BigInteger, "text": sa.Text}


def merged_rows(columns: dict[str, tuple[str, str]] = _v6._COLUMNS) -> str:
    """``request_rows`` with both parts tables merged in, as a subquery with request_rows' columns: a
    request with no parts as it is, the others grouped (the step parts padded with a sum's 0 and NULL)."""
    aggs = ", ".join(["request_id", *(f"{_v5._aggregate(c, columns)} AS {c}" for c in columns)])
    cols = ", ".join(["request_id", *columns])
    padded = ", ".join(
        ["request_id", *(c if c in STEP_COLUMNS else f"{'0' if a == 'sum' else 'NULL'} AS {c}" for c, (a, _) in columns.items())]
    )
    has_parts = (
        "(EXISTS (SELECT 1 FROM request_parts p WHERE p.request_id = q.request_id) "
        "OR EXISTS (SELECT 1 FROM request_step_parts p WHERE p.request_id = q.request_id))"
    )
    return (
        f"(SELECT {cols} FROM request_rows q WHERE NOT {has_parts} "
        f"UNION ALL SELECT {aggs} FROM ("
        f"SELECT {cols} FROM request_rows q WHERE {has_parts} "
        f"UNION ALL SELECT {cols} FROM request_parts "
        f"UNION ALL SELECT {padded} FROM request_step_parts) u GROUP BY request_id)"
    )


def upgrade() -> None:
    columns = _v6._COLUMNS
    op.create_table(
        "request_step_parts",
        sa.Column("request_id", sa.Text(), nullable=False),
        *(
            sa.Column(
                name,
                _TYPES[columns[name][1]](),
                nullable=columns[name][0] != "sum",
                server_default=sa.text("0") if columns[name][0] == "sum" else None,
            )
            for name in STEP_COLUMNS
        ),
    )
    op.execute("DROP VIEW requests")
    op.execute(_v6._view_sql(merged_rows()))


def downgrade() -> None:
    # What is not compacted yet moves to request_parts: nothing accepted is lost.
    cols = ", ".join(["request_id", *STEP_COLUMNS])
    op.execute(f"INSERT INTO request_parts ({cols}) SELECT {cols} FROM request_step_parts")
    op.execute("DROP VIEW requests")
    op.drop_table("request_step_parts")
    op.execute(_v6._view_sql(_v5._merged_rows(_v6._COLUMNS)))
