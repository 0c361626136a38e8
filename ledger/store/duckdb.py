"""DuckDB backend: the embedded default. The service process is the file's single writer."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import duckdb
import pyarrow as pa
import sqlalchemy as sa

from engine_hooks import events as ev
from ledger.fold import AGGREGATES, SUM_COLUMNS
from ledger.store.base import (
    EVENT_COLUMNS,
    REQUESTS_SCHEMA,
    STEP_COLUMNS,
    STEP_PARTS_SCHEMA,
    Prepared,
    Store,
    WriteResult,
    _SourceState,
    aggregate_sql,
    merge_sets,
    request_columns,
)
from ledger.store.request_owners import Owners
from ledger.store.step_memory import _Link

EVENTS_SCHEMA = pa.schema(
    [
        ("source_id", pa.string()),
        ("seq", pa.int64()),
        ("ts", pa.float64()),
        ("kind", pa.string()),
        ("request_id", pa.string()),
        ("data", pa.string()),
        ("ingested_ts", pa.float64()),
    ]
)
_STEP_TYPES = {
    "source_id": pa.string(),
    "ts": pa.float64(),
    "duration_s": pa.float64(),
    "kv_usage": pa.float64(),
    "interval_s": pa.float64(),
    "stalled_request_ids": pa.list_(pa.string()),
    "request_keys": pa.list_(pa.int64()),
}
STEPS_SCHEMA = pa.schema([(c, _STEP_TYPES.get(c, pa.int64())) for c in STEP_COLUMNS])
assert EVENTS_SCHEMA.names == EVENT_COLUMNS and STEPS_SCHEMA.names == STEP_COLUMNS

log = logging.getLogger(__name__)

_REQUEST_COLUMNS = ", ".join(REQUESTS_SCHEMA.names)
_APPEND_PARTS = f"INSERT INTO request_parts ({_REQUEST_COLUMNS}) SELECT {_REQUEST_COLUMNS} FROM _req_stage"
_STEP_PART_COLUMNS = ", ".join(STEP_PARTS_SCHEMA.names)
_APPEND_STEP_PARTS = (
    f"INSERT INTO request_step_parts ({_STEP_PART_COLUMNS}) SELECT {_STEP_PART_COLUMNS} FROM _step_part_stage"
)
_STEP_COLUMNS = ", ".join(STEP_COLUMNS)
_APPEND_STEPS = f"INSERT INTO steps ({_STEP_COLUMNS}) SELECT {_STEP_COLUMNS} FROM _step_stage"
_KEY_STAGE = pa.schema([("request_id", pa.string()), ("request_key", pa.int64())])
# Keys come from the writer's counter (the file's one writer), not the sequence. The plain insert is
# the usual path: ids the cache does not know are nearly always new (a request's first step), and it
# costs a third of DuckDB's ON CONFLICT (1.3 against 3.1 ms for 170 ids); an id that was stored
# after all fails it, and the group is written again with ON CONFLICT (``write``).
_INSERT_NEW_KEYS = (
    "INSERT INTO request_keys (request_id, request_key) SELECT request_id, request_key FROM _key_stage"
)
_INSERT_KEYS = _INSERT_NEW_KEYS + " ON CONFLICT DO NOTHING RETURNING request_id, request_key"
_LOOKUP_KEYS = (
    "SELECT request_id, request_key FROM request_keys WHERE request_id IN (SELECT request_id FROM _key_stage)"
)

# Owners (ledger.store.request_owners): the file has one writer, so the owners it met lately are what is
# stored (its cache), and the ids the cache does not know are nearly always new: a plain insert of them
# (an id stored after all fails it, and the group is written again with a lookup first). The lookup
# scans request_sources, which holds every request ever: 350 ids took 10 ms against 10k rows, 17 at
# 500k (an hour of a 236-engine fleet), 38 at 2M, and it ran every group.
_OWNER_STAGE = pa.schema(
    [("request_id", pa.string()), ("engine_source_id", pa.string()), ("gateway_source_id", pa.string())]
)
_LOOKUP_OWNERS = (
    "SELECT request_id, engine_source_id, gateway_source_id FROM request_sources "
    "WHERE request_id IN (SELECT request_id FROM _owner_stage)"
)
_INSERT_OWNERS = "INSERT INTO request_sources SELECT * FROM _owner_stage"
_FILL_OWNERS = (
    "UPDATE request_sources SET "
    "engine_source_id = coalesce(request_sources.engine_source_id, o.engine_source_id), "
    "gateway_source_id = coalesce(request_sources.gateway_source_id, o.gateway_source_id) "
    "FROM _owner_stage o WHERE request_sources.request_id = o.request_id"
)


# Compaction: one merged row per request of both parts tables (the step parts padded with a sum's 0
# and NULL), staged; the requests stored already get it added by an UPDATE, the others inserted; then
# every part is deleted. DuckDB's ON CONFLICT DO UPDATE cost 11 us per row merged (160 ms for 14k
# requests) where the UPDATE and INSERT take 3 and 3, and a DELETE with no WHERE 1 ms where one keeping
# rows took 100 (``bench/compaction.py``).
_PADDED = ", ".join(
    c if c in STEP_PARTS_SCHEMA.names else f"{'0' if c in SUM_COLUMNS else 'NULL'} AS {c}"
    for c in REQUESTS_SCHEMA.names
)
_COMPACT_STAGE = (
    "CREATE OR REPLACE TEMP TABLE _compact AS SELECT request_id, "
    + ", ".join(f"{aggregate_sql(c)} AS {c}" for c in AGGREGATES)
    + f" FROM (SELECT {_REQUEST_COLUMNS} FROM request_parts "
    + f"UNION ALL SELECT {_PADDED} FROM request_step_parts) GROUP BY request_id"
)
_COMPACT_UPDATE = (
    "UPDATE request_rows SET "
    + ", ".join(f"{col} = {expr}" for col, expr in merge_sets("request_rows", "_compact", wide_int="HUGEINT"))
    + " FROM _compact WHERE request_rows.request_id = _compact.request_id"
)
_COMPACT_INSERT = (
    f"INSERT INTO request_rows ({_REQUEST_COLUMNS}) SELECT {_REQUEST_COLUMNS} FROM _compact "
    "WHERE NOT EXISTS (SELECT 1 FROM request_rows r WHERE r.request_id = _compact.request_id)"
)
_LINK_STAGE = pa.schema(
    [
        ("prev_end", pa.float64()),
        ("source_id", pa.string()),
        ("step", pa.int64()),
        ("prev_seq", pa.int64()),
        ("lo", pa.float64()),
        ("hi", pa.float64()),
    ]
)
# One UPDATE for all of a group's links (DuckDB's per-statement cost is ~1 ms); the constant ts range
# spanning them lets the zone maps prune the scan, which a range from the joined table would not.
_LINK_SUCCESSORS = (
    "UPDATE steps SET interval_s = steps.ts + steps.duration_s - u.prev_end FROM _link_stage u "
    "WHERE steps.source_id = u.source_id AND steps.step = u.step AND steps.seq > u.prev_seq "
    "AND steps.ts BETWEEN u.lo AND u.hi AND steps.interval_s IS NULL AND steps.ts BETWEEN ? AND ?"
)
_SOURCES_STAGE = pa.schema(
    [
        ("source_id", pa.string()),
        ("last_seq", pa.int64()),
        ("accepted", pa.int64()),
        ("dropped", pa.int64()),
        ("model", pa.string()),
        ("producer", pa.string()),
    ]
)


class _Taken(Exception):
    """A group's plain insert of request ids the caches did not know (keys, owners) met one stored."""


class _Tx:
    """The writer connection inside one transaction (close() keeps the connection open)."""

    def __init__(self, duck: Any) -> None:
        self.duck = duck
        duck.execute("BEGIN TRANSACTION")

    def execute(self, sql: str, params: Any = None) -> Any:
        return self.duck.execute(sql, params)

    def commit(self) -> None:
        self.duck.execute("COMMIT")

    def rollback(self) -> None:
        with contextlib.suppress(Exception):  # no transaction left to roll back
            self.duck.execute("ROLLBACK")

    def close(self) -> None:
        pass


class DuckDBStore(Store):
    """The write path appends partial request rows to ``request_parts``; ``compact`` merges them.

    Compaction is due once the oldest partial row has waited ``compact_interval_s`` or
    ``compact_rows`` wait: one transaction merges one row per request into ``request_rows`` and
    deletes the parts. The ingest writer calls it between groups, after answering them, on the writer
    connection. (A compactor thread on a connection of its own measured a few % more ingest, but its
    commits and checkpoints made the writer's commits wait on DuckDB's locks for seconds on a loaded
    machine: the demo's cutoffs came late.) Each compaction costs a fixed part (a few statements and a
    commit) and a part per row, so it runs on the clock: compacting every 20k rows, as it once did,
    took 15-24 % of a fleet's ingest (``bench/compaction.py``). Reads merge what waits through the
    ``requests`` view; ``compact_rows`` bounds their extra work.
    """

    dialect = "duckdb"

    def __init__(
        self,
        engine: sa.Engine,
        *,
        compact_rows: int = 500_000,
        compact_interval_s: float = 5.0,
        checkpoint_threshold: str = "64MB",
        **kw: Any,
    ) -> None:
        super().__init__(engine, **kw)
        self.compact_rows = compact_rows
        self.compact_interval_s = compact_interval_s
        self._raw = engine.raw_connection()  # the writer connection, held for the store's life
        self._duck: Any = cast(Any, self._raw.driver_connection)
        # A commit that finds the WAL above this size checkpoints it into the file, inline. At DuckDB's
        # default (16 MB) the checkpoints were half the writer's commit time: much of a checkpoint's
        # cost does not grow with the WAL (3.2M events in-process: 65k -> 77k ev/s at 64 MB, no gain
        # at 256 MB). Replaying a 45 MB WAL after a kill took 0.16 s. Durability is unchanged: every
        # commit is in the fsynced WAL either way.
        self._duck.execute(f"SET checkpoint_threshold = '{checkpoint_threshold}'")
        self._lock = threading.Lock()
        rows = self._duck.execute("SELECT source_id, last_seq FROM sources").fetchall()
        self._marks: dict[str, int] = {sid: int(seq) for sid, seq in rows}
        # DuckDB imports pandas (when it is installed, e.g. with the dashboard) the first time a Python
        # object is registered. In the first ingest that import took 8 s on a saturated CI machine, and
        # every source waited behind it; pay it at start-up, before /readyz answers.
        self._duck.register("_warmup", pa.table({"x": [1]}))
        self._duck.unregister("_warmup")
        # Partial rows committed and not compacted yet, and since when the oldest waits.
        self._parts = int(
            self._duck.execute(
                "SELECT (SELECT count(*) FROM request_parts) + (SELECT count(*) FROM request_step_parts)"
            ).fetchall()[0][0]
        )
        self._parts_since: float | None = time.monotonic() if self._parts else None
        self._staged_parts = 0
        # The next request key to draw, and whether ids the key cache does not know are taken as new.
        self._next_key = int(
            self._duck.execute("SELECT coalesce(max(request_key), 0) + 1 FROM request_keys").fetchall()[0][0]
        )
        self._keys_new = True
        self._owners_new = True

    def write(self, batches: Any, producers: Any = None, columns: Any = None) -> list[WriteResult]:
        with self._lock:
            self._staged_parts = 0
            try:
                return super().write(batches, producers, columns)
            except _Taken:  # rolled back: an id the caches did not know was stored (a restart)
                self._keys_new = self._owners_new = False
                try:
                    return super().write(batches, producers, columns)
                finally:
                    self._keys_new = self._owners_new = True

    def release_producer(self, source_id: str, producer: str) -> None:
        with self._lock:  # beside the writer's transaction, which updates the same rows
            super().release_producer(source_id, producer)

    def compact_due(self) -> bool:
        since = self._parts_since
        return self._parts >= self.compact_rows or (
            since is not None and time.monotonic() - since >= self.compact_interval_s
        )

    def compact(self, force: bool = False) -> int:
        """Merge ``request_parts`` into ``request_rows`` when due (now, with ``force``); rows merged."""
        with self._lock:
            if not self._parts or not (force or self.compact_due()):
                return 0
            tx = self._connect()
            try:
                tx.execute(_COMPACT_STAGE)
                tx.execute(_COMPACT_UPDATE)
                tx.execute(_COMPACT_INSERT)
                tx.execute("DELETE FROM request_parts")
                tx.execute("DELETE FROM request_step_parts")
                tx.execute("DROP TABLE _compact")
                tx.commit()
            except BaseException:
                tx.rollback()
                raise
            n, self._parts, self._parts_since = self._parts, 0, None
            return n

    def _connect(self) -> _Tx:
        return _Tx(self._duck)

    def _lock_sources(self, conn: Any, sources: list[ev.Source], now: float) -> dict[str, int]:
        return {s.id: self._marks[s.id] for s in sources if s.id in self._marks}

    @contextlib.contextmanager
    def _staged(self, name: str, table: pa.Table) -> Iterator[Any]:
        """``table`` readable as ``name`` by the writer connection's statements in the block. After a
        failed statement the transaction is aborted and DuckDB refuses the unregister; the statement's
        own error is the one raised (the next registration under the name replaces it)."""
        duck = self._duck
        duck.register(name, table)
        try:
            yield duck
        except BaseException:
            with contextlib.suppress(Exception):
                duck.unregister(name)
            raise
        duck.unregister(name)

    def _append(self, conn: Any, prepared: Prepared) -> None:
        if prepared.events["seq"]:
            with self._staged("_ev_stage", pa.table(prepared.events, schema=EVENTS_SCHEMA)) as duck:
                duck.execute("INSERT INTO events SELECT * FROM _ev_stage")
        if prepared.steps["seq"]:
            with self._staged("_step_stage", pa.table(prepared.steps, schema=STEPS_SCHEMA)) as duck:
                duck.execute(_APPEND_STEPS)
        if prepared.requests:
            table = pa.table(request_columns(prepared.requests), schema=REQUESTS_SCHEMA)
            with self._staged("_req_stage", table) as duck:
                duck.execute(_APPEND_PARTS)
            self._staged_parts += table.num_rows
        steps = prepared.step_table()
        if steps is not None:
            with self._staged("_step_part_stage", steps) as duck:
                duck.execute(_APPEND_STEP_PARTS)
            self._staged_parts += steps.num_rows

    def _insert_keys(self, conn: Any, ids: list[str]) -> dict[str, int]:
        first = self._next_key
        keys = list(range(first, first + len(ids)))
        self._next_key = first + len(ids)  # a rolled-back group leaves a gap, never a key used twice
        with self._staged("_key_stage", pa.table([ids, keys], schema=_KEY_STAGE)) as duck:
            if not self._keys_new:
                return dict(duck.execute(_INSERT_KEYS).fetchall())
            try:
                duck.execute(_INSERT_NEW_KEYS)
            except duckdb.ConstraintException:
                duck.execute("ROLLBACK")  # the transaction is aborted; nothing else runs in it
                raise _Taken from None
            return dict(zip(ids, keys, strict=True))

    def _lookup_keys(self, conn: Any, ids: list[str]) -> dict[str, int]:
        with self._staged("_key_stage", pa.table([ids], names=["request_id"])) as duck:
            return dict(duck.execute(_LOOKUP_KEYS).fetchall())

    def _claim_owners(self, conn: Any, claims: dict[str, Owners]) -> dict[str, Owners]:
        def stage(rows: dict[str, Owners]) -> pa.Table:
            return pa.table(
                [list(rows), [o[0] for o in rows.values()], [o[1] for o in rows.values()]],
                schema=_OWNER_STAGE,
            )

        stored: dict[str, Owners]
        if self._owners_new:
            stored = {}
            new: dict[str, Owners] = {}
            for rid, claim in claims.items():
                known = self._owners.peek(rid)
                if known is None:
                    new[rid] = claim
                else:
                    stored[rid] = known
            if new:
                with self._staged("_owner_stage", stage(new)) as duck:
                    try:
                        duck.execute(_INSERT_OWNERS)
                    except duckdb.ConstraintException:
                        duck.execute("ROLLBACK")  # the transaction is aborted; nothing else runs in it
                        raise _Taken from None
        else:
            with self._staged("_owner_stage", stage(claims)) as duck:
                stored = {rid: (e, g) for rid, e, g in duck.execute(_LOOKUP_OWNERS).fetchall()}
            new = {rid: o for rid, o in claims.items() if rid not in stored}
            if new:
                with self._staged("_owner_stage", stage(new)) as duck:
                    duck.execute(_INSERT_OWNERS)
        # Stored ids whose kind no one owned yet and the group claims (a gateway's request the engine
        # names now): filled in, never replaced.
        fill = {
            rid: claims[rid]
            for rid, (e, g) in stored.items()
            if (e is None and claims[rid][0] is not None) or (g is None and claims[rid][1] is not None)
        }
        if fill:
            with self._staged("_owner_stage", stage(fill)) as duck:
                duck.execute(_FILL_OWNERS)
        for rid, (e, g) in fill.items():
            old = stored[rid]
            stored[rid] = (old[0] if old[0] is not None else e, old[1] if old[1] is not None else g)
        return {**new, **stored}

    def _link_successors(self, conn: Any, links: list[_Link]) -> None:
        if len(links) == 1:
            super()._link_successors(conn, links)
            return
        cols = list(zip(*links, strict=True))
        with self._staged("_link_stage", pa.table(cols, schema=_LINK_STAGE)):
            conn.execute(_LINK_SUCCESSORS, (min(cols[4]), max(cols[5])))

    def _save_sources(self, conn: Any, states: list[_SourceState], now: float) -> None:
        # One statement per kind of change: DuckDB's per-statement cost is ~1 ms, and a group holds
        # batches of many sources.
        changed = [st for st in states if st.exists and (st.accepted or st.dropped or st.producer)]
        if changed:
            stage = pa.table(
                {
                    "source_id": [st.source.id for st in changed],
                    "last_seq": [max(st.last_seq, st.new_last_seq) for st in changed],
                    "accepted": [st.accepted for st in changed],
                    "dropped": [st.dropped for st in changed],
                    "model": [st.source.model for st in changed],
                    "producer": [st.producer for st in changed],
                },
                schema=_SOURCES_STAGE,
            )
            with self._staged("_src_stage", stage):
                conn.execute(
                    "UPDATE sources SET last_seq = s.last_seq, events_total = events_total + s.accepted, "
                    "dropped_total = dropped_total + s.dropped, last_seen_ts = ?, "
                    "model = coalesce(s.model, sources.model), "
                    "producer = coalesce(s.producer, sources.producer) FROM _src_stage s "
                    "WHERE sources.source_id = s.source_id",
                    (now,),
                )
        for st in states:
            if not st.exists:
                last = max(st.last_seq, st.new_last_seq)
                conn.execute(
                    "INSERT INTO sources (source_id, kind, model, last_seq, events_total, dropped_total, "
                    "first_seen_ts, last_seen_ts, producer) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        st.source.id,
                        st.source.kind,
                        st.source.model,
                        last,
                        st.accepted,
                        st.dropped,
                        now,
                        now,
                        st.producer,
                    ),
                )

    def _after_commit(self, states: list[_SourceState]) -> None:
        for st in states:
            self._marks[st.source.id] = max(st.last_seq, st.new_last_seq)
        if self._staged_parts:
            self._parts += self._staged_parts
            if self._parts_since is None:
                self._parts_since = time.monotonic()

    def reader_connection(self) -> Any:
        """A new DuckDB connection to this store's instance, for reads beside the writer (ledger.sql)."""
        return self._duck.cursor()

    def close(self, compact: bool = True) -> None:
        """Close; ``compact``: merge what waits first (a clean shutdown)."""
        if compact:
            try:
                self.compact(force=True)
            except Exception:  # the parts stay; the view merges them and the next start compacts them
                log.exception("compacting request_parts at close failed")
        self._raw.close()
        super().close()
