"""Initial tables: sources, events, steps, requests.

Revision ID: 0001
Revises:
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sources",
        sa.Column("source_id", sa.Text(), primary_key=True),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("events_total", sa.BigInteger(), nullable=False),
        sa.Column("dropped_total", sa.BigInteger(), nullable=False),
        sa.Column("first_seen_ts", sa.Double(), nullable=False),
        sa.Column("last_seen_ts", sa.Double(), nullable=False),
    )
    op.create_table(
        "events",
        sa.Column("source_id", sa.Text(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("data", sa.Text(), nullable=True),
        sa.Column("ingested_ts", sa.Double(), nullable=False),
    )
    op.create_table(
        "steps",
        sa.Column("source_id", sa.Text(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("duration_s", sa.Double(), nullable=False),
        sa.Column("prefill_tokens", sa.BigInteger(), nullable=False),
        sa.Column("decode_tokens", sa.BigInteger(), nullable=False),
        sa.Column("num_prefill_reqs", sa.BigInteger(), nullable=False),
        sa.Column("num_decode_reqs", sa.BigInteger(), nullable=False),
        sa.Column("running", sa.BigInteger(), nullable=False),
        sa.Column("waiting", sa.BigInteger(), nullable=False),
        sa.Column("kv_usage", sa.Double(), nullable=False),
        sa.Column("request_ids", sa.ARRAY(sa.Text()), nullable=False),
    )
    op.create_table(
        "requests",
        sa.Column("request_id", sa.Text(), primary_key=True),
        sa.Column("model", sa.Text(), nullable=True, comment="served model (from the engine source)"),
        sa.Column("engine_source_id", sa.Text(), nullable=True, comment="engine source that ran the request"),
        sa.Column("gateway_source_id", sa.Text(), nullable=True, comment="gateway source that proxied it"),
        sa.Column("arrived_ts", sa.Double(), nullable=True, comment="gateway received the request"),
        sa.Column("admission_enqueued_ts", sa.Double(), nullable=True, comment="entered the gateway admission queue"),
        sa.Column("admitted_ts", sa.Double(), nullable=True, comment="gateway forwarded it to the engine"),
        sa.Column("engine_arrival_ts", sa.Double(), nullable=True, comment="engine front end received it"),
        sa.Column("queued_ts", sa.Double(), nullable=True, comment="engine scheduler queued it"),
        sa.Column("first_scheduled_ts", sa.Double(), nullable=True, comment="first prefill chunk scheduled"),
        sa.Column("first_token_ts", sa.Double(), nullable=True, comment="first output token"),
        sa.Column("last_token_ts", sa.Double(), nullable=True, comment="last output token"),
        sa.Column("finished_ts", sa.Double(), nullable=True, comment="engine finished it"),
        sa.Column("first_byte_ts", sa.Double(), nullable=True, comment="gateway saw the first response byte"),
        sa.Column("completed_ts", sa.Double(), nullable=True, comment="gateway finished the response"),
        sa.Column("disconnected_ts", sa.Double(), nullable=True, comment="client disconnected"),
        sa.Column("stream_cut_ts", sa.Double(), nullable=True, comment="gateway cut the stream on a command"),
        sa.Column("last_event_ts", sa.Double(), nullable=True, comment="newest event of the request"),
        sa.Column("entry_measured_s", sa.Double(), nullable=False, server_default=sa.text("0"), comment="gateway: arrived -> admission queue"),
        sa.Column("admission_wait_s", sa.Double(), nullable=False, server_default=sa.text("0"), comment="gateway: time in the admission queue"),
        sa.Column("backend_wait_measured_s", sa.Double(), nullable=False, server_default=sa.text("0"), comment="engine: queued -> scheduled, plus preempted -> resumed"),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=True, comment="prompt length"),
        sa.Column("max_tokens", sa.BigInteger(), nullable=True, comment="output cap the client asked for"),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False, server_default=sa.text("0"), comment="prefix-cache hits when first scheduled"),
        sa.Column("prefill_computed_tokens", sa.BigInteger(), nullable=False, server_default=sa.text("0"), comment="prompt tokens computed for the first time"),
        sa.Column("recomputed_tokens", sa.BigInteger(), nullable=False, server_default=sa.text("0"), comment="tokens computed again after preemptions"),
        sa.Column("output_tokens", sa.BigInteger(), nullable=True, comment="output tokens produced"),
        sa.Column("chunks", sa.BigInteger(), nullable=False, server_default=sa.text("0"), comment="prefill chunks (all passes)"),
        sa.Column("preemptions", sa.BigInteger(), nullable=False, server_default=sa.text("0"), comment="times preempted"),
        sa.Column("resumes", sa.BigInteger(), nullable=False, server_default=sa.text("0"), comment="times resumed after a preemption"),
        sa.Column("kv_blocks_max", sa.BigInteger(), nullable=True, comment="most KV blocks held at once"),
        sa.Column("token_events", sa.BigInteger(), nullable=False, server_default=sa.text("0"), comment="tokens events (coalesced groups of output tokens)"),
        sa.Column("events", sa.BigInteger(), nullable=False, server_default=sa.text("0"), comment="events folded into this row"),
        sa.Column("finish_reason", sa.Text(), nullable=True, comment="stop | length | abort | cutoff | error"),
        sa.Column("stop_reason", sa.Text(), nullable=True, comment="engine stop reason, e.g. chunkledger:<rule>"),
        sa.Column("status_code", sa.BigInteger(), nullable=True, comment="HTTP status the gateway sent"),
        sa.Column("cut_rule", sa.Text(), nullable=True, comment="rule of the cutoff applied to it"),
    )
    if op.get_bind().dialect.name == "postgresql":
        # DuckDB: the single writer enforces (source_id, seq) uniqueness; see ledger/schema.py.
        op.create_index("events_source_seq_key", "events", ["source_id", "seq"], unique=True)
        op.create_index("events_request_id_idx", "events", ["request_id"])
        op.create_index("steps_source_step_idx", "steps", ["source_id", "step"])


def downgrade() -> None:
    for table in ("requests", "steps", "events", "sources"):
        op.drop_table(table)
