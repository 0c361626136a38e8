"""DuckDB backend: the embedded default. The service process is the file's single writer."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, cast

import pyarrow as pa
import sqlalchemy as sa

from engine_hooks import events as ev
from ledger.fold import AGGREGATES
from ledger.store.base import (
    EVENT_COLUMNS,
    STEP_COLUMNS,
    Prepared,
    Store,
    WriteResult,
    _SourceState,
    merge_sql,
    request_columns,
)

_ARROW = {"float": pa.float64(), "int": pa.int64(), "str": pa.string()}
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
STEPS_SCHEMA = pa.schema(
    [(c, pa.string() if c == "source_id" else pa.int64()) for c in STEP_COLUMNS[:3]]
    + [("ts", pa.float64()), ("duration_s", pa.float64())]
    + [(c, pa.int64()) for c in STEP_COLUMNS[5:11]]
    + [("kv_usage", pa.float64()), ("request_ids", pa.list_(pa.string()))]
    + [("prefill_depth_tokens", pa.int64()), ("max_prefill_depth", pa.int64())]
    + [("stalled_request_ids", pa.list_(pa.string())), ("interval_s", pa.float64())]
)
REQUESTS_SCHEMA = pa.schema(
    [("request_id", pa.string())] + [(c, _ARROW[a.type]) for c, a in AGGREGATES.items()]
)
assert EVENTS_SCHEMA.names == EVENT_COLUMNS and STEPS_SCHEMA.names == STEP_COLUMNS

_MERGE = merge_sql("request_rows", "_req_stage")
_SOURCES_STAGE = pa.schema(
    [
        ("source_id", pa.string()),
        ("last_seq", pa.int64()),
        ("accepted", pa.int64()),
        ("dropped", pa.int64()),
        ("model", pa.string()),
    ]
)


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
    dialect = "duckdb"

    def __init__(self, engine: sa.Engine, **kw: Any) -> None:
        super().__init__(engine, **kw)
        self._raw = engine.raw_connection()  # the writer connection, held for the store's life
        self._duck: Any = cast(Any, self._raw.driver_connection)
        self._lock = threading.Lock()
        rows = self._duck.execute("SELECT source_id, last_seq FROM sources").fetchall()
        self._marks: dict[str, int] = {sid: int(seq) for sid, seq in rows}
        # DuckDB imports pandas (when it is installed, e.g. with the dashboard) the first time a Python
        # object is registered. In the first ingest that import took 8 s on a saturated CI machine, and
        # every source waited behind it; pay it at start-up, before /readyz answers.
        self._duck.register("_warmup", pa.table({"x": [1]}))
        self._duck.unregister("_warmup")

    def write(self, batches: Any) -> list[WriteResult]:
        with self._lock:
            return super().write(batches)

    def _connect(self) -> _Tx:
        return _Tx(self._duck)

    def _lock_sources(self, conn: Any, sources: list[ev.Source], now: float) -> dict[str, int]:
        return {s.id: self._marks[s.id] for s in sources if s.id in self._marks}

    def _append(self, conn: Any, prepared: Prepared) -> None:
        duck = self._duck
        if prepared.events["seq"]:
            duck.register("_ev_stage", pa.table(prepared.events, schema=EVENTS_SCHEMA))
            duck.execute("INSERT INTO events SELECT * FROM _ev_stage")
            duck.unregister("_ev_stage")
        if prepared.steps["seq"]:
            duck.register("_step_stage", pa.table(prepared.steps, schema=STEPS_SCHEMA))
            duck.execute("INSERT INTO steps SELECT * FROM _step_stage")
            duck.unregister("_step_stage")
        if prepared.requests:
            duck.register("_req_stage", pa.table(request_columns(prepared.requests), schema=REQUESTS_SCHEMA))
            duck.execute(_MERGE)
            duck.unregister("_req_stage")

    def _save_sources(self, conn: Any, states: list[_SourceState], now: float) -> None:
        # One statement per kind of change: DuckDB's per-statement cost is ~1 ms, and a group holds
        # batches of many sources.
        changed = [st for st in states if st.exists and (st.accepted or st.dropped)]
        if changed:
            stage = pa.table(
                {
                    "source_id": [st.source.id for st in changed],
                    "last_seq": [max(st.last_seq, st.new_last_seq) for st in changed],
                    "accepted": [st.accepted for st in changed],
                    "dropped": [st.dropped for st in changed],
                    "model": [st.source.model for st in changed],
                },
                schema=_SOURCES_STAGE,
            )
            self._duck.register("_src_stage", stage)
            conn.execute(
                "UPDATE sources SET last_seq = s.last_seq, events_total = events_total + s.accepted, "
                "dropped_total = dropped_total + s.dropped, last_seen_ts = ?, "
                "model = coalesce(s.model, sources.model) FROM _src_stage s "
                "WHERE sources.source_id = s.source_id",
                (now,),
            )
            self._duck.unregister("_src_stage")
        for st in states:
            if not st.exists:
                last = max(st.last_seq, st.new_last_seq)
                conn.execute(
                    "INSERT INTO sources VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (st.source.id, st.source.kind, st.source.model, last, st.accepted, st.dropped, now, now),
                )

    def _after_commit(self, states: list[_SourceState]) -> None:
        for st in states:
            self._marks[st.source.id] = max(st.last_seq, st.new_last_seq)

    def reader_connection(self) -> Any:
        """A new DuckDB connection to this store's instance, for reads beside the writer (ledger.sql)."""
        return self._duck.cursor()

    def close(self) -> None:
        self._raw.close()
        super().close()
