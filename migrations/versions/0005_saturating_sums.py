"""The requests view saturates integer sums at 2^63 - 1 instead of failing.

The view merges ``request_rows`` with ``request_parts`` and casts each integer ``sum`` back to BIGINT.
A request whose summed counts passed 2^63 - 1 (three events of 2^62 tokens each were enough before the
contract bounded them) made that cast fail, and with it every read of the view, every export and every
compaction, for good. The contract now bounds each summed count to 2^31 - 1; this view (and the write
paths' merges, ledger.store.base.merge_sql) saturate at 2^63 - 1 as well, so no stored data can make
the view unreadable.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from alembic import op

from ledger.migrate import revision_module

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_v4 = revision_module("0004_request_parts")
INT64_MAX = 2**63 - 1


def _aggregate(col: str, columns: dict[str, tuple[str, str]]) -> str:
    """``col``'s merge over ``columns`` (name -> (aggregate, type)), integer sums saturating."""
    agg, type_ = columns[col]
    if agg == "sum" and type_ == "bigint":
        # sum(bigint) widens (numeric on PostgreSQL, hugeint on DuckDB), so the LEAST cannot overflow.
        return f"CAST(LEAST(sum({col}), {INT64_MAX}) AS BIGINT)"
    return f"{agg}({col})"


def _merged_rows(columns: dict[str, tuple[str, str]] = _v4._COLUMNS) -> str:
    """0004's merged rows over the tables' ``columns`` (0006 adds some), with saturating sums."""
    aggs = ", ".join(["request_id", *(f"{_aggregate(c, columns)} AS {c}" for c in columns)])
    return _v4._merged_rows(aggs, ", ".join(["request_id", *columns]))


def upgrade() -> None:
    op.execute("DROP VIEW requests")
    op.execute(_v4._view_sql(_merged_rows()))


def downgrade() -> None:
    op.execute("DROP VIEW requests")
    op.execute(_v4._view_sql(_v4._merged_rows()))
