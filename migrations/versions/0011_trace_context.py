"""W3C trace context on request rows: ``trace_id``, ``parent_span_id``, ``span_id``.

``request_rows`` and ``request_parts`` gain three text columns, each merged with max (a request has one
trace; the gateway's ``arrived`` sets all three, and without a gateway the engine's ``queued`` sets the
first two from the context vLLM received). The ``requests`` view is rebuilt over them, so SQL can join
a request to the spans of a trace backend (``WHERE trace_id = '...'``).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

from ledger.migrate import revision_module

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_v6 = revision_module("0006_client_side")
_v10 = revision_module("0010_step_parts")

_NEW: dict[str, tuple[str, str, str]] = {
    "trace_id": ("max", "text", "W3C trace id the request ran under (32 hex digits)"),
    "parent_span_id": ("max", "text", "the caller's span that sent the request (16 hex digits)"),
    "span_id": ("max", "text", "the gateway's span for the request, the parent of the engine's"),
}
# request_rows' columns after this migration, in table order: name -> (aggregate, type).
_COLUMNS: dict[str, tuple[str, str]] = {**_v6._COLUMNS, **{c: (a, t) for c, (a, t, _) in _NEW.items()}}


def upgrade() -> None:
    op.execute("DROP VIEW requests")
    for name, (_, _, doc) in _NEW.items():
        op.add_column("request_rows", sa.Column(name, sa.Text(), nullable=True, comment=doc))
        op.add_column("request_parts", sa.Column(name, sa.Text(), nullable=True))
    op.execute(_v6._view_sql(_v10.merged_rows(_COLUMNS)))


def downgrade() -> None:
    op.execute("DROP VIEW requests")
    for name in reversed(_NEW):
        op.drop_column("request_parts", name)
        op.drop_column("request_rows", name)
    op.execute(_v6._view_sql(_v10.merged_rows()))
