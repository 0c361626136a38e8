"""Attribution: requests becomes a view over request_rows; wait split, step participation, KV idle.

* ``requests`` is renamed ``request_rows`` (the fold target) and gains fold columns: waits split by
  what they delayed, step participation and KV idle time.
* ``steps`` gains the prefill-depth work of the step, the requests it left stalled, and the interval
  since the previous step's end (the inter-token gap of a request decoding in both).
* A view ``requests`` adds the four-layer attribution, and the start and end points they span, to
  every row (see ledger/schema.py, ATTRIBUTION and SPAN).

The view's SQL is frozen here. A later migration that changes ``request_rows`` must drop and
re-create the view (PostgreSQL binds ``r.*`` when the view is created).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_NEW_REQUEST_COLUMNS = [
    ("requeue_wait_prefill_s", sa.Double(), "preempted -> resumed waits before the first token"),
    ("requeue_wait_decode_s", sa.Double(), "preempted -> resumed waits after the first token"),
    ("final_wait_s", sa.Double(), "wait that ended with the request finishing while waiting"),
    ("step_count", sa.BigInteger(), "engine steps it took part in (a chunk or a decode)"),
    ("active_s", sa.Double(), "summed duration of the steps it took part in"),
    ("last_step_ts", sa.Double(), "end of the last step it took part in"),
    ("stalled_steps", sa.BigInteger(), "steps it sat out while holding KV blocks"),
    ("kv_idle_s", sa.Double(), "seconds holding KV blocks with no progress (steps sat out)"),
    ("kv_idle_block_s", sa.Double(), "KV block-seconds held idle (blocks x seconds sat out)"),
]
_MAX_COLUMNS = {"last_step_ts"}  # the rest are sums (NOT NULL DEFAULT 0)


def _view_sql(rows: str = "request_rows") -> str:
    """CREATE VIEW requests over ``rows`` (a table, or a subquery with request_rows' columns)."""
    gw = "(r.arrived_ts IS NOT NULL OR r.admission_enqueued_ts IS NOT NULL OR r.admitted_ts IS NOT NULL)"
    t0 = (
        f"(CASE WHEN {gw} THEN COALESCE(r.arrived_ts, r.admission_enqueued_ts, r.admitted_ts) "
        "ELSE COALESCE(r.engine_arrival_ts, r.queued_ts, r.first_scheduled_ts) END)"
    )
    t1 = (
        f"(CASE WHEN {gw} THEN COALESCE(r.admission_enqueued_ts, r.admitted_ts, r.arrived_ts) "
        "ELSE COALESCE(r.queued_ts, r.engine_arrival_ts, r.first_scheduled_ts) END)"
    )
    t2 = f"(CASE WHEN {gw} THEN COALESCE(r.admitted_ts, r.admission_enqueued_ts, r.arrived_ts) ELSE {t1} END)"
    t5 = "COALESCE(r.completed_ts, r.disconnected_ts, r.finished_ts)"
    tok = "COALESCE(r.first_token_ts, r.first_byte_ts)"
    t4 = f"COALESCE({tok}, {t5})"
    t3 = f"COALESCE(r.first_scheduled_ts, {t4})"
    sched = "r.first_scheduled_ts IS NOT NULL"
    w_pre = f"(r.requeue_wait_prefill_s + CASE WHEN {sched} AND {tok} IS NULL THEN r.final_wait_s ELSE 0 END)"
    w_dec = (
        f"(r.requeue_wait_decode_s + CASE WHEN {sched} AND {tok} IS NOT NULL THEN r.final_wait_s ELSE 0 END)"
    )
    done = f"{t5} IS NOT NULL"
    layers = {
        "entry_s": f"{t1} - {t0}",
        "admission_s": f"{t2} - {t1}",
        "backend_wait_s": f"({t3} - {t2}) + {w_pre} + {w_dec}",
        "backend_wait_ttft_s": f"({t3} - {t2}) + {w_pre}",
        "prefill_s": f"({t4} - {t3}) - {w_pre}",
        "decode_s": f"({t5} - {t4}) - {w_dec}",
        "e2e_s": f"{t5} - {t0}",
    }
    cols = [f"CASE WHEN {done} THEN {expr} END AS {name}" for name, expr in layers.items()]
    cols.append(f"{tok} - {t0} AS ttft_s")
    cols.append(f"{t0} AS start_ts")
    cols.append(f"{t5} AS end_ts")
    return "CREATE VIEW requests AS SELECT r.*, " + ", ".join(cols) + f" FROM {rows} r"


def upgrade() -> None:
    op.rename_table("requests", "request_rows")
    for name, type_, doc in _NEW_REQUEST_COLUMNS:
        is_sum = name not in _MAX_COLUMNS
        op.add_column(
            "request_rows",
            sa.Column(
                name,
                type_,
                nullable=not is_sum,
                server_default=sa.text("0") if is_sum else None,
                comment=doc,
            ),
        )
    op.add_column(
        "steps",
        sa.Column("prefill_depth_tokens", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )
    op.add_column(
        "steps", sa.Column("max_prefill_depth", sa.BigInteger(), nullable=False, server_default=sa.text("0"))
    )
    op.add_column("steps", sa.Column("stalled_request_ids", sa.ARRAY(sa.Text()), nullable=True))
    op.add_column("steps", sa.Column("interval_s", sa.Double(), nullable=True))
    op.execute(_view_sql())
    if op.get_bind().dialect.name == "postgresql":  # DuckDB scans steps by ts with zone maps
        op.create_index("steps_ts_idx", "steps", ["ts"])


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("steps_ts_idx", "steps")
    op.execute("DROP VIEW requests")
    for name in ("interval_s", "stalled_request_ids", "max_prefill_depth", "prefill_depth_tokens"):
        op.drop_column("steps", name)
    for name, _, _ in reversed(_NEW_REQUEST_COLUMNS):
        op.drop_column("request_rows", name)
    op.rename_table("request_rows", "requests")
