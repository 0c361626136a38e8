"""Sources are bound to their producer.

* ``sources.producer``: a digest of the key of the producer (an exporter) that owns the source id
  (``ledger.producers``); NULL while no batch of the source carried one (older exporters).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE sources ADD COLUMN producer TEXT")


def downgrade() -> None:
    op.execute("ALTER TABLE sources DROP COLUMN producer")
