"""Requests are owned by the sources that serve them.

* ``request_sources`` (request_id, engine_source_id, gateway_source_id): the first engine source and the
  first gateway source that named each request (``ledger.store.request_owners``); events another source
  of the same kind sends about it are refused. Filled from the requests stored so far.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "CREATE TABLE request_sources (request_id TEXT PRIMARY KEY, engine_source_id TEXT, "
        "gateway_source_id TEXT)"
    )
    op.execute(
        "INSERT INTO request_sources SELECT request_id, engine_source_id, gateway_source_id FROM requests "
        "WHERE engine_source_id IS NOT NULL OR gateway_source_id IS NOT NULL"
    )


def downgrade() -> None:
    op.execute("DROP TABLE request_sources")
