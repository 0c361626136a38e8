"""Steps name their requests by integer key, not by id.

A step of a busy engine names every request it ran: 256 ids of ~30 characters each, a list per row.
Stored as ``TEXT[]`` these were the largest single cost of the write path: DuckDB's commit (its WAL)
took about 650 ns per id against 140 ns for a ``BIGINT`` (docs/benchmarks.md, "Participation by key").

* ``request_keys`` (request_id, request_key): one row per request a step named, its key drawn from the
  sequence ``request_key_seq`` when a step first names it, so keys rise with time (DuckDB's zone maps
  find a key's row without an index; PostgreSQL gets a unique index on ``request_key``).
* ``steps.request_keys BIGINT[]`` replaces ``steps.request_ids``; existing steps keep their requests in
  order (keys numbered by first appearance).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _mapped(pg: bool, new: str, old: str, match: str, take: str, sql_type: str) -> None:
    """Add ``steps.<new>`` holding ``steps.<old>`` mapped element by element through ``request_keys``
    (each element matched on column ``match``, replaced by column ``take``), in order; drop ``old``."""
    op.execute(f"ALTER TABLE steps ADD COLUMN {new} {sql_type}[]")
    empty = f"'{{}}'::{sql_type}[]" if pg else f"[]::{sql_type}[]"
    op.execute(
        f"UPDATE steps SET {new} = coalesce((SELECT array_agg(k.{take} ORDER BY u.n) FROM unnest(steps.{old}) "
        f"WITH ORDINALITY AS u(x, n) JOIN request_keys k ON k.{match} = u.x), {empty})"
    )
    op.execute(f"ALTER TABLE steps ALTER COLUMN {new} SET NOT NULL")
    op.execute(f"ALTER TABLE steps DROP COLUMN {old}")


def upgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    op.execute("CREATE SEQUENCE request_key_seq START 1")
    op.execute(
        "CREATE TABLE request_keys (request_id TEXT PRIMARY KEY, "
        "request_key BIGINT NOT NULL DEFAULT nextval('request_key_seq'))"
    )
    op.execute(
        "INSERT INTO request_keys (request_id) SELECT rid FROM "
        "(SELECT unnest(request_ids) AS rid, ts FROM steps) AS named GROUP BY rid ORDER BY min(ts), rid"
    )
    if pg:
        op.execute("CREATE UNIQUE INDEX request_keys_key_idx ON request_keys (request_key)")
    _mapped(pg, "request_keys", "request_ids", "request_id", "request_key", "BIGINT")


def downgrade() -> None:
    _mapped(op.get_bind().dialect.name == "postgresql", "request_ids", "request_keys", "request_key", "request_id", "TEXT")
    op.execute("DROP TABLE request_keys")
    op.execute("DROP SEQUENCE request_key_seq")
