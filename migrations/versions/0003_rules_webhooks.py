"""Runaway rules, commands and webhooks: cutoffs, policy_versions, webhook subscriptions/outbox/attempts.

Leaves request_rows and the requests view alone.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "cutoffs",
        sa.Column("command_id", sa.Text(), primary_key=True),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("rule", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=True),
        sa.Column("source_id", sa.Text(), nullable=True),
        sa.Column("gateway_source_id", sa.Text(), nullable=True),
        sa.Column("decided_ts", sa.Double(), nullable=False),
        sa.Column("delivered_ts", sa.Double(), nullable=True),
        sa.Column("applied_ts", sa.Double(), nullable=True),
        sa.Column("applied_source_id", sa.Text(), nullable=True),
        sa.Column("gateway_delivered_ts", sa.Double(), nullable=True),
        sa.Column("gateway_applied_ts", sa.Double(), nullable=True),
        sa.Column("deliveries", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("closed_ts", sa.Double(), nullable=True),
        sa.UniqueConstraint("request_id", "rule", name="cutoffs_request_rule_key"),
    )
    op.create_table(
        "policy_versions",
        sa.Column("version", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("created_ts", sa.Double(), nullable=False),
        sa.Column("origin", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
    )
    op.create_table(
        "webhook_subscriptions",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column("event_types", sa.Text(), nullable=False),
        sa.Column("format", sa.Text(), nullable=False),
        sa.Column("created_ts", sa.Double(), nullable=False),
        sa.Column("deleted_ts", sa.Double(), nullable=True),
    )
    op.create_table(
        "webhook_outbox",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("subscription_id", sa.Text(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column("event_id", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("created_ts", sa.Double(), nullable=False),
        sa.Column("next_attempt_ts", sa.Double(), nullable=False),
        sa.Column("attempts", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("last_status", sa.BigInteger(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("delivered_ts", sa.Double(), nullable=True),
        sa.Column("lease_until", sa.Double(), nullable=True),
    )
    op.create_table(
        "webhook_attempts",
        sa.Column("delivery_id", sa.Text(), nullable=False),
        sa.Column("attempt", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.Double(), nullable=False),
        sa.Column("status_code", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("duration_s", sa.Double(), nullable=False),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.create_index("cutoffs_state_idx", "cutoffs", ["state"])
        op.create_index("webhook_outbox_due_idx", "webhook_outbox", ["state", "next_attempt_ts"])
        op.create_index("webhook_attempts_delivery_idx", "webhook_attempts", ["delivery_id"])


def downgrade() -> None:
    for table in (
        "webhook_attempts",
        "webhook_outbox",
        "webhook_subscriptions",
        "policy_versions",
        "cutoffs",
    ):
        op.drop_table(table)
