"""Table definitions (SQLAlchemy Core). Alembic migrations in ``migrations/`` create and upgrade them.

* ``sources``  one row per event source: its kind, model and high-water mark (``last_seq``).
* ``events``   every accepted event, append-only; ``(source_id, seq)`` is unique. ``data`` holds the
  event's fields as JSON (output token ids removed unless configured). ``step`` events are stored
  here by identity only (``data`` NULL); their fields live in ``steps``.
* ``steps``    one row per engine step.
* ``requests`` one row per request, the merge of its events (see ``ledger.fold``).
"""

from __future__ import annotations

import sqlalchemy as sa

from ledger.fold import AGGREGATES

metadata = sa.MetaData()

_SQL_TYPES: dict[str, type[sa.types.TypeEngine]] = {"float": sa.Double, "int": sa.BigInteger, "str": sa.Text}

sources = sa.Table(
    "sources",
    metadata,
    sa.Column("source_id", sa.Text, primary_key=True),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("model", sa.Text),
    sa.Column("last_seq", sa.BigInteger, nullable=False),
    sa.Column("events_total", sa.BigInteger, nullable=False),
    sa.Column("dropped_total", sa.BigInteger, nullable=False),
    sa.Column("first_seen_ts", sa.Double, nullable=False),
    sa.Column("last_seen_ts", sa.Double, nullable=False),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("source_id", sa.Text, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("ts", sa.Double, nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("request_id", sa.Text),
    sa.Column("data", sa.Text),
    sa.Column("ingested_ts", sa.Double, nullable=False),
)

steps = sa.Table(
    "steps",
    metadata,
    sa.Column("source_id", sa.Text, nullable=False),
    sa.Column("seq", sa.BigInteger, nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("ts", sa.Double, nullable=False),
    sa.Column("duration_s", sa.Double, nullable=False),
    sa.Column("prefill_tokens", sa.BigInteger, nullable=False),
    sa.Column("decode_tokens", sa.BigInteger, nullable=False),
    sa.Column("num_prefill_reqs", sa.BigInteger, nullable=False),
    sa.Column("num_decode_reqs", sa.BigInteger, nullable=False),
    sa.Column("running", sa.BigInteger, nullable=False),
    sa.Column("waiting", sa.BigInteger, nullable=False),
    sa.Column("kv_usage", sa.Double, nullable=False),
    sa.Column("request_ids", sa.ARRAY(sa.Text), nullable=False),
)

requests = sa.Table(
    "requests",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    *(
        sa.Column(
            name,
            _SQL_TYPES[agg.type],
            nullable=agg.op != "sum",
            server_default=sa.text("0") if agg.op == "sum" else None,
            comment=agg.doc,
        )
        for name, agg in AGGREGATES.items()
    ),
)

# Indexes that only PostgreSQL gets: on DuckDB the unique (source_id, seq) is enforced by the single
# writer (high-water mark plus a range check), and request lookups scan with zone maps; an ART index
# over tens of millions of rows would cost the append path more than it saves.
PG_ONLY_INDEXES = (
    sa.Index("events_source_seq_key", events.c.source_id, events.c.seq, unique=True),
    sa.Index("events_request_id_idx", events.c.request_id),
    sa.Index("steps_source_step_idx", steps.c.source_id, steps.c.step),
)
