"""What the client saw, and the backend wait split at the engine's door.

* ``request_rows`` and ``request_parts`` gain ``first_token_out_ts`` and ``last_token_out_ts``: when the
  gateway wrote the first and the last generated content to the client (``first_token_out`` events,
  ``last_token_out_s`` on ``completed`` and ``client_disconnected``), and ``first_wait_s``: the
  engine's own measure of its first wait (the first chunk's ``wait_s``; the vLLM plugin's is vLLM's
  SCHEDULED - QUEUED span, the figure behind vLLM's ``request_queue_time_seconds``).
* The ``requests`` view splits ``backend_wait_s`` into ``frontend_s`` (forwarded by the gateway ->
  queued by the engine's scheduler: HTTP to the API server, its tokenising, the IPC to the engine core)
  and ``engine_queue_s`` (queued -> first scheduled, plus every preempted -> resumed wait; the first
  wait is ``first_wait_s`` where the engine measured it, within forwarded -> first scheduled, and the
  timestamps' difference otherwise); their sum is
  ``backend_wait_s`` as before, so the layers still add up to ``e2e_s``. Without a gateway the engine's
  front end (arrival -> queued) is ``frontend_s`` too (it was ``entry_s``: entry and admission are the
  gateway's layers).
* It adds ``client_ttft_s`` (gateway arrival -> first content written to the client) and
  ``delivery_s`` (the engine's first token -> that write: detokenising, the API server's stream, HTTP,
  the gateway's relay). ``ttft_s`` no longer falls back to ``first_byte_ts``, which is the upstream's
  response headers, sent before the engine has queued the request; it falls back to the first content
  out instead.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

from ledger.migrate import revision_module

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_v4 = revision_module("0004_request_parts")
_v5 = revision_module("0005_saturating_sums")

_NEW: dict[str, tuple[str, str, str]] = {
    "first_token_out_ts": ("min", "double", "gateway wrote the first generated content to the client"),
    "last_token_out_ts": ("max", "double", "gateway wrote the last generated content to the client"),
    "first_wait_s": ("min", "double", "engine: queued -> first scheduled, as the engine measured it"),
}
# request_rows' columns after this migration, in table order: name -> (aggregate, type).
_COLUMNS: dict[str, tuple[str, str]] = {**_v4._COLUMNS, **{c: (a, t) for c, (a, t, _) in _NEW.items()}}


def _view_sql(rows: str) -> str:
    """CREATE VIEW requests over ``rows`` (a subquery with request_rows' columns)."""
    gw = "(r.arrived_ts IS NOT NULL OR r.admission_enqueued_ts IS NOT NULL OR r.admitted_ts IS NOT NULL)"
    # t0 arrival, t1 admission queue, t2 forwarded, tq engine queued, t3 first scheduled, t4 first
    # token, t5 end. Without a gateway, t0 = t1 = t2 = the engine front end's arrival.
    t0 = (
        f"(CASE WHEN {gw} THEN COALESCE(r.arrived_ts, r.admission_enqueued_ts, r.admitted_ts) "
        "ELSE COALESCE(r.engine_arrival_ts, r.queued_ts, r.first_scheduled_ts) END)"
    )
    t1 = f"(CASE WHEN {gw} THEN COALESCE(r.admission_enqueued_ts, r.admitted_ts, r.arrived_ts) ELSE {t0} END)"
    t2 = f"(CASE WHEN {gw} THEN COALESCE(r.admitted_ts, r.admission_enqueued_ts, r.arrived_ts) ELSE {t0} END)"
    t5 = "COALESCE(r.completed_ts, r.disconnected_ts, r.finished_ts)"
    tok = "COALESCE(r.first_token_ts, r.first_token_out_ts)"
    t4 = f"COALESCE({tok}, {t5})"
    t3 = f"COALESCE(r.first_scheduled_ts, {t4})"
    # Engine queued, kept within [t2, t3] (the gateway's and the engine's clocks may disagree); no
    # engine events: all of the backend wait is behind the engine's door as far as we can see.
    tq = f"GREATEST({t2}, LEAST(COALESCE(r.queued_ts, {t3}), {t3}))"
    sched = "r.first_scheduled_ts IS NOT NULL"
    w_pre = f"(r.requeue_wait_prefill_s + CASE WHEN {sched} AND {tok} IS NULL THEN r.final_wait_s ELSE 0 END)"
    w_dec = (
        f"(r.requeue_wait_decode_s + CASE WHEN {sched} AND {tok} IS NOT NULL THEN r.final_wait_s ELSE 0 END)"
    )
    # The engine's measured first wait where it has one (and it was scheduled), kept within t2..t3; the
    # front end is the rest of forwarded -> first scheduled. Else the timestamps' split at tq.
    measured = f"(r.first_wait_s IS NOT NULL AND {sched})"
    first_wait = f"LEAST(r.first_wait_s, {t3} - {t2})"
    frontend = f"(CASE WHEN {measured} THEN ({t3} - {t2}) - {first_wait} ELSE {tq} - {t2} END)"
    queue_first = f"(CASE WHEN {measured} THEN {first_wait} ELSE {t3} - {tq} END)"
    done = f"{t5} IS NOT NULL"
    layers = {
        "entry_s": f"{t1} - {t0}",
        "admission_s": f"{t2} - {t1}",
        # backend_wait_s is the same sum as frontend_s + engine_queue_s, so the two agree to the bit
        "backend_wait_s": f"{frontend} + ({queue_first} + {w_pre} + {w_dec})",
        "backend_wait_ttft_s": f"{frontend} + ({queue_first} + {w_pre})",
        "frontend_s": frontend,
        "engine_queue_s": f"{queue_first} + {w_pre} + {w_dec}",
        "prefill_s": f"({t4} - {t3}) - {w_pre}",
        "decode_s": f"({t5} - {t4}) - {w_dec}",
        "e2e_s": f"{t5} - {t0}",
    }
    cols = [f"CASE WHEN {done} THEN {expr} END AS {name}" for name, expr in layers.items()]
    cols.append(f"{tok} - {t0} AS ttft_s")
    cols.append(f"r.first_token_out_ts - {t0} AS client_ttft_s")
    cols.append("r.first_token_out_ts - r.first_token_ts AS delivery_s")
    cols.append(f"{t0} AS start_ts")
    cols.append(f"{t5} AS end_ts")
    return "CREATE VIEW requests AS SELECT r.*, " + ", ".join(cols) + f" FROM {rows} r"


def upgrade() -> None:
    op.execute("DROP VIEW requests")
    for name, (_, _, doc) in _NEW.items():
        op.add_column("request_rows", sa.Column(name, sa.Double(), nullable=True, comment=doc))
        op.add_column("request_parts", sa.Column(name, sa.Double(), nullable=True))
    op.execute(_view_sql(_v5._merged_rows(_COLUMNS)))


def downgrade() -> None:
    op.execute("DROP VIEW requests")
    for name in reversed(_NEW):
        op.drop_column("request_parts", name)
        op.drop_column("request_rows", name)
    op.execute(_v4._view_sql(_v5._merged_rows()))
