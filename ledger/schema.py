"""Table definitions (SQLAlchemy Core). Alembic migrations in ``migrations/`` create and upgrade them.

* ``sources``  one row per event source: its kind, model, high-water mark (``last_seq``) and the digest
  of its producer's key (``producer``, see ``ledger.producers``).
* ``events``   every accepted event, append-only; ``(source_id, seq)`` is unique. ``data`` holds the
  event's fields as JSON (output token ids removed unless configured). ``step`` events are stored
  here by identity only (``data`` NULL); their fields live in ``steps``.
* ``steps``    one row per engine step. The requests it ran are ``request_keys``, integer keys into
  ``request_keys`` (migration 0007): a step of a busy engine names hundreds of requests, and storing
  their ids as text cost the write path more than the rest of the step (docs/benchmarks.md).
* ``request_keys`` one row per request a step named: its id and the key steps store for it, assigned
  from the sequence ``request_key_seq`` the first time a step names it (so keys rise with time).
* ``request_sources`` one row per request: the engine source and the gateway source that own it, the
  first of each kind to name it (``ledger.store.request_owners``, migration 0009).
* ``request_rows`` one row per request, the merge of its events (see ``ledger.fold``); only the
  write path touches it.
* ``request_parts`` partial request rows not merged into ``request_rows`` yet: the DuckDB write path
  appends a group's partial rows here (an append costs a quarter of the upsert) and compacts them into
  ``request_rows`` every few seconds; PostgreSQL merges directly and leaves it empty (migration 0004).
* ``request_step_parts`` the same for the partial rows a group's steps fold into, in the ten columns
  steps set (migration 0010: appended to ``request_parts``, their NULLs were most of DuckDB's WAL).
* ``requests`` a VIEW: ``request_rows`` with both parts tables merged in, plus the four-layer attribution
  derived from the columns (``ATTRIBUTION``; the view's SQL lives in migrations 0006 and 0004). Every read
  and every user query uses it, so a read sees every committed event whether compacted or not.
"""

from __future__ import annotations

import sqlalchemy as sa

from ledger.fold import AGGREGATES, STEP_FOLD_COLUMNS

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
    # A digest of the key of the producer that owns the id (ledger.producers; migration 0008).
    sa.Column("producer", sa.Text),
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
    sa.Column("prefill_depth_tokens", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    sa.Column("max_prefill_depth", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    sa.Column("stalled_request_ids", sa.ARRAY(sa.Text)),
    # End of the previous step of the same source -> end of this one: the gap a request decoding in
    # both steps saw between its tokens. Set at ingest when the previous step is known (NULL otherwise).
    sa.Column("interval_s", sa.Double),
    # The requests the step ran (``request_keys.request_key``), in the engine's order.
    sa.Column("request_keys", sa.ARRAY(sa.BigInteger), nullable=False),
)

request_keys = sa.Table(
    "request_keys",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("request_key", sa.BigInteger, nullable=False),
)


request_sources = sa.Table(
    "request_sources",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("engine_source_id", sa.Text),
    sa.Column("gateway_source_id", sa.Text),
)


def step_request_ids_sql(steps: str = "steps") -> str:
    """SQL (DuckDB and PostgreSQL) for the ids of the requests a row of ``steps`` (a table name or
    alias) ran, in order: its ``request_keys`` named. For one request, compare keys instead:
    ``array_position(request_keys, (SELECT request_key FROM request_keys WHERE request_id = '...'))
    IS NOT NULL`` (``ledger.analytics.common.ran_in_step``: ``= ANY`` is 4x slower on DuckDB)."""
    return (
        f"ARRAY(SELECT k.request_id FROM unnest({steps}.request_keys) WITH ORDINALITY AS u(key, n) "
        "JOIN request_keys k ON k.request_key = u.key ORDER BY u.n)"
    )


def _aggregate_columns(
    *, comments: bool = True, only: tuple[str, ...] | None = None
) -> list[sa.Column[object]]:
    return [
        sa.Column(
            name,
            _SQL_TYPES[agg.type],
            nullable=agg.op != "sum",
            server_default=sa.text("0") if agg.op == "sum" else None,
            comment=agg.doc if comments else None,
        )
        for name, agg in AGGREGATES.items()
        if only is None or name in only
    ]


request_rows = sa.Table(
    "request_rows",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    *_aggregate_columns(),
)

# No key: appends only, several rows per request (one per write group it appeared in).
request_parts = sa.Table(
    "request_parts",
    metadata,
    sa.Column("request_id", sa.Text, nullable=False),
    *_aggregate_columns(comments=False),
)

# No key either: a group's steps folded, one row per request (``ledger.fold.StepFold``), in only the
# columns steps set (migration 0010).
request_step_parts = sa.Table(
    "request_step_parts",
    metadata,
    sa.Column("request_id", sa.Text, nullable=False),
    *_aggregate_columns(comments=False, only=STEP_FOLD_COLUMNS),
)

# The four-layer attribution, seconds, derived by the view from the merged row (its SQL: migration
# 0006): entry_s + admission_s + backend_wait_s + prefill_s + decode_s = e2e_s exactly, backend_wait_s
# = frontend_s + engine_queue_s, and entry_s + admission_s + backend_wait_ttft_s + prefill_s = ttft_s.
# NULL while the request is live (ttft_s, client_ttft_s, delivery_s: until the first token).
ATTRIBUTION: dict[str, str] = {
    "entry_s": "entry layer: gateway arrived -> admission queue (0 without a gateway)",
    "admission_s": "admission layer: time in the gateway's admission queue -> forwarded",
    "backend_wait_s": "backend wait: frontend_s + engine_queue_s",
    "backend_wait_ttft_s": "the part of backend_wait_s before the first token",
    "frontend_s": "engine front end: forwarded (no gateway: engine arrival) -> queued by the scheduler "
    "(HTTP, the API server, tokenising, IPC to the engine core)",
    "engine_queue_s": "engine queue: queued -> first scheduled (first_wait_s where the engine measured it), "
    "plus every preempted -> resumed wait",
    "prefill_s": "batch prefill: first scheduled -> first token, less waits while preempted",
    "decode_s": "batch decode: first token -> end, less waits while preempted",
    "e2e_s": "end to end: arrival -> response complete (gateway clock when there is one)",
    "ttft_s": "time to first token: arrival -> the engine's first token (no engine events: first token out)",
    "client_ttft_s": "time to first token as the client saw it: arrival -> first content written to it",
    "delivery_s": "the first token's way back: engine's first token -> written to the client by the gateway",
}

# The points the layers span (unix seconds; end_ts NULL while live).
SPAN: dict[str, str] = {
    "start_ts": "arrival: gateway arrived_ts, else the engine's arrival",
    "end_ts": "end: gateway completed_ts, else disconnected_ts, else engine finished_ts",
}

# Not in ``metadata``: migrations create the view; this object lets queries name its columns.
_views = sa.MetaData()
requests = sa.Table(
    "requests",
    _views,
    sa.Column("request_id", sa.Text, primary_key=True),
    *_aggregate_columns(),
    *(sa.Column(name, sa.Double, comment=doc) for name, doc in ATTRIBUTION.items()),
    *(sa.Column(name, sa.Double, comment=doc) for name, doc in SPAN.items()),
)

# Indexes that only PostgreSQL gets: on DuckDB the unique (source_id, seq) is enforced by the single
# writer (high-water mark plus a range check), and request lookups scan with zone maps; an ART index
# over tens of millions of rows would cost the append path more than it saves. Building an ``sa.Index``
# attaches it to its table, so the metadata (and the migration check against it) knows them; nothing
# reads the tuple itself.
PG_ONLY_INDEXES = (
    sa.Index("events_source_seq_key", events.c.source_id, events.c.seq, unique=True),
    sa.Index("events_request_id_idx", events.c.request_id),
    sa.Index("steps_source_step_idx", steps.c.source_id, steps.c.step),
    sa.Index("steps_ts_idx", steps.c.ts),  # windows over steps (ITL, the chunk-size fit); migration 0002
    # key -> id for the steps a read names; DuckDB's zone maps do it there (keys rise with time)
    sa.Index("request_keys_key_idx", request_keys.c.request_key, unique=True),
)

# -- Runaway rules, commands and webhooks (migration 0003) ------------------------------------------
# * ``cutoffs``  one row per decision (a command): who decided what for which request, and where it is
#   in delivery. ``source_id`` is the engine that runs the request, ``gateway_source_id`` the gateway
#   streaming it (when one was); each confirms on its own. ``state``: pending until every target has
#   confirmed (applied) or has finished the request without it (moot), or the ttl ran out (expired).
# * ``policy_versions``  every accepted policy document, newest is live.
# * ``webhook_subscriptions``, ``webhook_outbox`` (one row per delivery to one subscriber, retried until
#   delivered or dead) and ``webhook_attempts`` (the delivery log, one row per HTTP attempt).
cutoffs = sa.Table(
    "cutoffs",
    metadata,
    sa.Column("command_id", sa.Text, primary_key=True),
    sa.Column("request_id", sa.Text, nullable=False),
    sa.Column("rule", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("detail", sa.Text, nullable=False),
    sa.Column("model", sa.Text),
    sa.Column("source_id", sa.Text),
    sa.Column("gateway_source_id", sa.Text),
    sa.Column("decided_ts", sa.Double, nullable=False),
    sa.Column("delivered_ts", sa.Double),
    sa.Column("applied_ts", sa.Double),
    sa.Column("applied_source_id", sa.Text),
    sa.Column("gateway_delivered_ts", sa.Double),
    sa.Column("gateway_applied_ts", sa.Double),
    sa.Column("deliveries", sa.BigInteger, nullable=False, server_default=sa.text("0")),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("closed_ts", sa.Double),
    sa.UniqueConstraint("request_id", "rule", name="cutoffs_request_rule_key"),
)

policy_versions = sa.Table(
    "policy_versions",
    metadata,
    sa.Column("version", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("created_ts", sa.Double, nullable=False),
    sa.Column("origin", sa.Text, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
)

webhook_subscriptions = sa.Table(
    "webhook_subscriptions",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("secret", sa.Text, nullable=False),
    sa.Column("event_types", sa.Text, nullable=False),
    sa.Column("format", sa.Text, nullable=False),
    sa.Column("created_ts", sa.Double, nullable=False),
    sa.Column("deleted_ts", sa.Double),
)

webhook_outbox = sa.Table(
    "webhook_outbox",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("subscription_id", sa.Text, nullable=False),
    sa.Column("event_type", sa.Text, nullable=False),
    sa.Column("event_id", sa.Text, nullable=False),
    sa.Column("body", sa.Text, nullable=False),
    sa.Column("created_ts", sa.Double, nullable=False),
    sa.Column("next_attempt_ts", sa.Double, nullable=False),
    sa.Column("attempts", sa.BigInteger, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("last_status", sa.BigInteger),
    sa.Column("last_error", sa.Text),
    sa.Column("delivered_ts", sa.Double),
    sa.Column("lease_until", sa.Double),
)

webhook_attempts = sa.Table(
    "webhook_attempts",
    metadata,
    sa.Column("delivery_id", sa.Text, nullable=False),
    sa.Column("attempt", sa.BigInteger, nullable=False),
    sa.Column("ts", sa.Double, nullable=False),
    sa.Column("status_code", sa.BigInteger),
    sa.Column("error", sa.Text),
    sa.Column("duration_s", sa.Double, nullable=False),
)

# PostgreSQL only (migration 0003), like PG_ONLY_INDEXES: pending commands, due webhook deliveries.
RULES_PG_ONLY_INDEXES = (
    sa.Index("cutoffs_state_idx", cutoffs.c.state),
    sa.Index("webhook_outbox_due_idx", webhook_outbox.c.state, webhook_outbox.c.next_attempt_ts),
    sa.Index("webhook_attempts_delivery_idx", webhook_attempts.c.delivery_id),
)
