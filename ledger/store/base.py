"""Storage: the write path shared by both backends, and the reads.

One call to ``Store.write`` stores a group of batches in one transaction (group commit):

1. lock the sources involved and read their high-water marks (``sources.last_seq``);
2. deduplicate: an event whose seq is above the mark is new; one at or below it is looked up in
   ``events`` (a range probe that only retries and reordered batches pay for);
3. append the accepted events and steps with the backend's bulk path, fold the accepted request
   events into partial rows and merge them into ``request_rows`` with one upsert (PostgreSQL) or
   append them to ``request_parts``, merged later by ``compact`` (DuckDB);
4. advance the marks and commit. Nothing is acknowledged before the commit returns.

``steps.interval_s`` (end of the source's previous step -> end of this one) does not depend on the
order in which batches arrive, nor on restarts: see ``Store._link_steps``.

Backends implement the few steps that differ (locking, bulk append, upsert staging).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pyarrow as pa
import sqlalchemy as sa

from engine_hooks import events as ev
from ledger import schema
from ledger.columnar import Columns
from ledger.fold import (
    AGGREGATES,
    STEP_FOLD_COLUMNS,
    SUM_COLUMNS,
    Row,
    StepFold,
    fold_into,
    fold_step_columns,
    fold_steps,
)
from ledger.store.request_keys import KeyCache, keys_for
from ledger.store.request_owners import Owners, foreign_ids, names_any
from ledger.store.step_memory import MAX_STEP_GAP_S, _follows, _Link, _StepEnd, _StepMemory

EVENT_COLUMNS = [c.name for c in schema.events.columns]
STEP_COLUMNS = [c.name for c in schema.steps.columns]
# Copied from the Step as is (``request_keys`` are its ``request_ids`` as keys, resolved per group).
STEP_FIELDS = [c for c in STEP_COLUMNS if c not in ("source_id", "interval_s", "request_keys")]
_ARROW = {"float": pa.float64(), "int": pa.int64(), "str": pa.string()}
# Partial request rows as the bulk paths stage them (request_rows' columns), and a group's steps'
# (request_step_parts: the columns steps set).
REQUESTS_SCHEMA = pa.schema(
    [("request_id", pa.string())] + [(c, _ARROW[a.type]) for c, a in AGGREGATES.items()]
)
STEP_PARTS_SCHEMA = pa.schema(
    [("request_id", pa.string())] + [(c, _ARROW[AGGREGATES[c].type]) for c in STEP_FOLD_COLUMNS]
)


@dataclass
class WriteResult:
    accepted: int
    duplicates: int
    # Seqs already stored with other content (a conflicting replay): not stored again, not duplicates.
    conflicts: list[int] = field(default_factory=list)
    # Request ids another source of the batch's kind owns (``ledger.store.request_owners``): the events
    # naming them were refused, neither stored nor counted as duplicates.
    foreign: list[str] = field(default_factory=list)


@dataclass
class _SourceState:
    source: ev.Source
    last_seq: int  # -1 when new
    exists: bool
    producer: str | None = None  # the producer digest its accepted batches carried (ledger.producers)
    accepted: int = 0
    dropped: int = 0
    new_last_seq: int = -1
    # Rows in ``Prepared.steps`` of this source's accepted steps (``interval_s`` linked per group), and
    # the group's steps by number as ``_link_steps`` saw them (remembered after the commit).
    step_rows: list[int] = field(default_factory=list)
    step_group: dict[int, _StepEnd] | None = None


@dataclass
class Prepared:
    """Column lists ready for the bulk paths, built from the accepted events of a group."""

    events: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in EVENT_COLUMNS})
    steps: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in STEP_COLUMNS})
    requests: dict[str, Row] = field(default_factory=dict)
    # Accepted steps naming requests, folded into ``requests`` for the whole group at once (``fold``).
    step_events: list[ev.Step] = field(default_factory=list)
    # Each row of ``steps``' request ids, turned into its ``request_keys`` once the group is in; a
    # columnar message stored whole stands for the rows of all its steps (and its steps fold from its
    # columns, not from ``step_events``).
    step_ids: list[list[str] | Columns] = field(default_factory=list)
    # The keys the group's transaction resolved (remembered after the commit).
    new_keys: dict[str, int] = field(default_factory=dict)
    # The steps of the columnar messages, folded per request for the whole group at once.
    step_fold: StepFold | None = None

    def fold(self, codes: list[np.ndarray]) -> None:
        """Fold the group's steps into partial rows: JSON steps into ``requests`` (as columns above a
        few hundred participants), the columnar messages' steps into ``step_fold`` from their columns,
        ``codes`` naming each message's requests across the group (its ids' request keys)."""
        if self.step_events:
            fold_steps(self.requests, self.step_events)
            self.step_events = []
        parts = [p for p in self.step_ids if isinstance(p, Columns)]
        if parts:
            self.step_fold = fold_step_columns(
                [(p.steps, p.ids, c) for p, c in zip(parts, codes, strict=True)]
            )

    def step_table(self) -> pa.Table | None:
        """The partial rows of the group's columnar steps, in the columns steps set
        (``STEP_PARTS_SCHEMA``); None without any."""
        fold = self.step_fold
        if fold is None or not fold.ids:
            return None
        n = len(fold.ids)
        arrays = [pa.array(fold.ids, pa.string())]
        for f in STEP_PARTS_SCHEMA:
            if f.name == "request_id":
                continue
            v = fold.columns.get(f.name)
            if f.name in SUM_COLUMNS:
                if v is None:
                    v = _zeros(n, f.type)
                elif f.name == "kv_idle_block_s":  # NaN where no step said its blocks
                    v = np.nan_to_num(v)
                arrays.append(pa.array(v, f.type))
            elif v is None:
                arrays.append(pa.nulls(n, f.type))
            else:  # minima and maxima a request's steps did not set: NULL
                unset = v < 0 if f.name == "output_tokens" else np.isnan(v)
                arrays.append(pa.array(v, f.type, mask=unset))
        return pa.Table.from_arrays(arrays, schema=STEP_PARTS_SCHEMA)

    def request_table(self) -> pa.Table:
        """All the group's partial request rows in request_rows' columns: those of its events and those
        of its columnar steps (a request may have one of each; the backend merges them)."""
        # (an empty table from Python lists costs 0.2 ms: 100 ns a token of a message)
        table = pa.table(request_columns(self.requests), schema=REQUESTS_SCHEMA) if self.requests else None
        steps = self.step_table()
        if steps is None:
            return table if table is not None else REQUESTS_SCHEMA.empty_table()
        n = steps.num_rows
        wide = pa.Table.from_arrays(
            [
                steps.column(f.name)
                if f.name in STEP_PARTS_SCHEMA.names
                else pa.array(_zeros(n, f.type), f.type)
                if f.name in SUM_COLUMNS
                else pa.nulls(n, f.type)
                for f in REQUESTS_SCHEMA
            ],
            schema=REQUESTS_SCHEMA,
        )
        return pa.concat_tables([table, wide]) if table is not None else wide


def _zeros(n: int, type_: pa.DataType) -> np.ndarray:
    """A sum column no row sets, in its own dtype."""
    return np.zeros(n, np.int64 if type_ == pa.int64() else np.float64)


_encode = msgspec.json.Encoder().encode
_TAGS: dict[type, str] = {cls: kind for kind, cls in ev.EVENT_TYPES.items()}
_NO_REQUEST_ID = frozenset({ev.Step, ev.Dropped})


def merge_sets(table: str, other: str, *, wide_int: str) -> list[tuple[str, str]]:
    """Each aggregate column of ``table`` and the expression that merges ``other``'s partial row into it.

    LEAST/GREATEST ignore NULLs on DuckDB and PostgreSQL alike. Integer sums are added in ``wide_int``
    (HUGEINT on DuckDB, NUMERIC on PostgreSQL) and saturate at 2^63 - 1, so no row can fail the merge
    (or, on DuckDB, every later compaction)."""
    sets = []
    for col, agg in AGGREGATES.items():
        if agg.op == "sum" and agg.type == "int":
            expr = f"CAST(LEAST(CAST({table}.{col} AS {wide_int}) + {other}.{col}, {ev.INT64_MAX}) AS BIGINT)"
        elif agg.op == "sum":
            expr = f"{table}.{col} + {other}.{col}"
        elif agg.op == "min":
            expr = f"LEAST({table}.{col}, {other}.{col})"
        else:
            expr = f"GREATEST({table}.{col}, {other}.{col})"
        sets.append((col, expr))
    return sets


def aggregate_sql(col: str) -> str:
    """The aggregate that merges a column over partial rows (GROUP BY request_id), in the column's type:
    an integer sum is widened by the database (HUGEINT, NUMERIC) and saturates at 2^63 - 1."""
    agg = AGGREGATES[col]
    if agg.op == "sum" and agg.type == "int":
        return f"CAST(LEAST(sum({col}), {ev.INT64_MAX}) AS BIGINT)"
    return f"{agg.op}({col})"


def grouped(table: str) -> str:
    """``table``'s partial rows merged into one per request, as a subquery."""
    aggs = ", ".join(f"{aggregate_sql(c)} AS {c}" for c in AGGREGATES)
    return f"(SELECT request_id, {aggs} FROM {table} GROUP BY request_id) AS _grouped"


def merge_sql(table: str, staging: str, *, wide_int: str) -> str:
    """INSERT ... ON CONFLICT DO UPDATE merging staged partial rows into ``request_rows`` (``merge_sets``)."""
    col_list = ", ".join(["request_id", *AGGREGATES])
    sets = ", ".join(f"{col} = {expr}" for col, expr in merge_sets(table, "excluded", wide_int=wide_int))
    return (
        f"INSERT INTO {table} ({col_list}) SELECT {col_list} FROM {staging} "
        f"ON CONFLICT (request_id) DO UPDATE SET {sets}"
    )


def request_columns(rows: dict[str, Row]) -> dict[str, list[Any]]:
    """Partial rows as columns; sums default to 0 so the upsert can add them.

    A group's rows set few of the columns (a request that only decoded sets its token and step
    columns): a column no row sets is its default repeated, without a lookup per row."""
    cols: dict[str, list[Any]] = {"request_id": list(rows)}
    values = list(rows.values())
    present: set[str] = set()
    for r in values:
        present.update(r)
    n = len(values)
    for col in AGGREGATES:
        default = 0 if col in SUM_COLUMNS else None
        cols[col] = [r.get(col, default) for r in values] if col in present else [default] * n
    return cols


class Store:
    """Base class: the shared write algorithm and the reads (SQLAlchemy Core on both backends)."""

    dialect: str = ""

    def __init__(self, engine: sa.Engine, *, persist_token_ids: bool = False) -> None:
        self.engine = engine
        self.persist_token_ids = persist_token_ids
        # source id -> the steps it knows of, for steps.interval_s (updated after each commit).
        self._step_memory: dict[str, _StepMemory] = {}
        # Seconds per phase of the last write (the writer logs them for a slow group).
        self.last_write_phases: dict[str, float] = {}
        self._keys: KeyCache[int] = KeyCache()  # request id -> request_keys.request_key, met lately
        self._owners: KeyCache[Owners] = KeyCache(1 << 16)  # request id -> its owners, met lately

    # -- backend hooks -------------------------------------------------------------------------
    def _connect(self) -> Any:
        raise NotImplementedError

    def _lock_sources(self, conn: Any, sources: list[ev.Source], now: float) -> dict[str, int]:
        """Lock the sources' rows for this transaction; their high-water marks (absent: unknown)."""
        raise NotImplementedError

    # The driver's parameter style differs by backend ("?" for DuckDB, "%s" for psycopg).
    _EXISTING_SQL = (
        "SELECT seq, kind, ts, request_id, data, ingested_ts FROM events WHERE source_id = ? "
        "AND seq BETWEEN ? AND ?"
    )

    def _existing(self, conn: Any, source_id: str, lo: int, hi: int) -> dict[int, _Stored]:
        """The stored events of ``source_id`` with seqs in ``lo..hi``, as the conflict check reads them."""
        rows = conn.execute(self._EXISTING_SQL, (source_id, lo, hi)).fetchall()
        return {r[0]: _Stored(*r[1:]) for r in rows}

    # The predecessor of a step (source, step - 1, an earlier seq, ts within MAX_STEP_GAP_S), when memory
    # cannot tell; and the interval of a stored successor whose predecessor arrived late. The ``ts`` range
    # lets DuckDB's zone maps skip the row groups outside it; PostgreSQL uses (source_id, step).
    _PREDECESSOR_SQL = (
        "SELECT seq, ts, ts + duration_s FROM steps WHERE source_id = ? AND step = ? AND seq < ? "
        "AND ts BETWEEN ? AND ? ORDER BY seq DESC LIMIT 1"
    )
    _LINK_SUCCESSOR_SQL = (
        "UPDATE steps SET interval_s = ts + duration_s - ? WHERE source_id = ? AND step = ? AND seq > ? "
        "AND ts BETWEEN ? AND ? AND interval_s IS NULL"
    )

    def _append(self, conn: Any, prepared: Prepared) -> None:
        raise NotImplementedError

    def _insert_keys(self, conn: Any, ids: list[str]) -> dict[str, int]:
        """Draw keys for those of ``ids`` (distinct) not in ``request_keys`` yet; the keys drawn."""
        raise NotImplementedError

    def _lookup_keys(self, conn: Any, ids: list[str]) -> dict[str, int]:
        """The stored keys of ``ids``."""
        raise NotImplementedError

    def _claim_owners(self, conn: Any, claims: dict[str, Owners]) -> dict[str, Owners]:
        """Store ``claims`` where no owner of that kind is stored; the stored owners of every claimed id
        (``ledger.store.request_owners``)."""
        raise NotImplementedError

    def _save_sources(self, conn: Any, states: list[_SourceState], now: float) -> None:
        raise NotImplementedError

    def _after_commit(self, states: list[_SourceState]) -> None:
        pass

    def compact(self, force: bool = False) -> int:
        """Merge partial request rows written since the last compaction, when due; rows merged.

        Only backends that append partial rows (DuckDB) have any; reads see them either way.
        """
        return 0

    def close(self) -> None:
        self.engine.dispose()

    # -- write path ----------------------------------------------------------------------------
    def write(
        self,
        batches: Sequence[ev.Batch],
        producers: Sequence[str | None] | None = None,
        columns: Sequence[Columns | None] | None = None,
    ) -> list[WriteResult]:
        """Store ``batches`` in one transaction; per batch, how many events were new / duplicates.

        ``producers``: per batch, the digest of the producer key it came with (``ledger.producers``,
        which decides who may send), stored as its source's ``producer``. ``columns``: per batch, the
        columnar message it was decoded from, or None; the steps of the batches stored whole are
        folded from their columns, all at once (``ledger.fold.fold_step_columns``), not from their
        events."""
        now = time.time()
        sources = {b.source.id: b.source for b in batches}
        ids = sorted(sources)  # one lock order for every writer: no deadlocks between replicas
        clock = time.perf_counter
        t0 = clock()
        conn = self._connect()
        try:
            marks = self._lock_sources(conn, [sources[i] for i in ids], now)
            states = {
                sid: _SourceState(source=sources[sid], last_seq=marks.get(sid, -1), exists=sid in marks)
                for sid in ids
            }
            for i, p in enumerate(producers or ()):
                if p is not None:
                    states[batches[i].source.id].producer = p
            t1 = clock()
            prepared = Prepared()
            foreign, owners = foreign_ids(self._owners, conn, batches, self._claim_owners)
            results = [
                self._accept(
                    conn, b, states[b.source.id], prepared, now, foreign[i], columns[i] if columns else None
                )
                for i, b in enumerate(batches)
            ]
            codes: list[np.ndarray] = []
            if prepared.steps["seq"]:
                prepared.steps["request_keys"], prepared.new_keys, codes = keys_for(
                    self._keys, conn, prepared.step_ids, self._insert_keys, self._lookup_keys
                )
                self._link_steps(conn, prepared, states)
            prepared.fold(codes)
            t2 = clock()
            if any(r.accepted for r in results):
                self._append(conn, prepared)
            t3 = clock()
            self._save_sources(conn, list(states.values()), now)
            t4 = clock()
            conn.commit()
            t5 = clock()
        except BaseException:
            conn.rollback()
            raise
        finally:
            conn.close()
        self._remember_steps(prepared, states)
        if prepared.new_keys:
            self._keys.learn(prepared.new_keys)
        if owners:
            self._owners.learn(owners)
        self._after_commit(list(states.values()))
        self.last_write_phases = {
            "lock": t1 - t0,
            "prepare": t2 - t1,
            "append": t3 - t2,
            "sources": t4 - t3,
            "commit": t5 - t4,
        }
        return results

    def _accept(
        self,
        conn: Any,
        batch: ev.Batch,
        state: _SourceState,
        prepared: Prepared,
        now: float,
        foreign: set[str],
        columns: Columns | None = None,
    ) -> WriteResult:
        evs = batch.events
        if foreign:  # events about requests another source owns: refused
            evs = [e for e in evs if not names_any(e, foreign)]
        mark = state.last_seq if state.new_last_seq < 0 else state.new_last_seq
        fresh = [e for e in evs if e.seq > mark]
        old = [e for e in evs if e.seq <= mark]
        conflicts: list[int] = []
        if old:
            # Seqs at or below the high-water mark: retries (usual) or a batch overtaken by a later one.
            # One whose stored event differs is a conflicting replay: refused (the API answers 409
            # naming it), never counted as a duplicate.
            sid = state.source.id
            seen = self._existing(conn, sid, old[0].seq, old[-1].seq)
            seen.update(_accepted_in_group(prepared, sid, old[0].seq, old[-1].seq, now))
            if seen:
                conflicts = [e.seq for e in old if e.seq in seen and self._differs(e, seen[e.seq])]
            old = [e for e in old if e.seq not in seen]
            accepted = sorted(old + fresh, key=lambda e: e.seq) if old else fresh
        else:
            accepted = fresh
        if accepted:
            state.new_last_seq = max(mark, accepted[-1].seq)
            state.accepted += len(accepted)
            whole = columns if len(accepted) == len(batch.events) else None  # else its steps' events fold
            self._prepare(batch.source, accepted, prepared, now, state, whole)
        return WriteResult(
            accepted=len(accepted),
            duplicates=len(evs) - len(accepted) - len(conflicts),
            conflicts=conflicts,
            foreign=sorted(foreign),
        )

    def _differs(self, e: Any, stored: _Stored) -> bool:
        """Whether ``e`` is another event than the one stored under its (source, seq).

        Compared as stored: kind, request id, time and (for every kind but ``step``, whose fields live in
        ``steps``) the JSON of its fields. A time the ledger clamped to its receive time (an event stamped
        too far ahead, ``ledger.validation.clamp_future``) is clamped again on a retry, to a later receive
        time: a time at or after the stored event's ingest is taken as that clamp, not as a conflict.
        """
        if type(e) is not ev.EVENT_TYPES.get(stored.kind):
            return True
        if type(e) is ev.Step:
            return e.ts != stored.ts and e.ts < stored.ingested_ts
        if getattr(e, "request_id", None) != stored.request_id:
            return True
        if type(e) is ev.Tokens and not self.persist_token_ids and e.token_ids is not None:
            e = msgspec.structs.replace(e, token_ids=None)
        data = _encode(e).decode()
        if data == stored.data:
            return False
        sent = msgspec.json.decode(data)
        had = msgspec.json.decode(stored.data) if stored.data else {}
        for key in _CLAMPED:
            if key in sent and sent[key] != had.get(key) and sent[key] >= stored.ingested_ts:
                sent[key] = had.get(key)
        return bool(sent != had)

    def _prepare(
        self,
        source: ev.Source,
        accepted: list[Any],
        prepared: Prepared,
        now: float,
        state: _SourceState,
        columns: Columns | None = None,
    ) -> None:
        """Append the accepted events of one batch to the group's columns and fold them.

        Column by column with comprehensions: the per-event loop of appends it replaced cost more than
        the decoding of the batch.
        """
        step_cls, tokens_cls = ev.Step, ev.Tokens
        no_request = _NO_REQUEST_ID
        sid = source.id
        n = len(accepted)
        if not self.persist_token_ids:
            replace = msgspec.structs.replace
            accepted = [
                replace(e, token_ids=None) if type(e) is tokens_cls and e.token_ids is not None else e
                for e in accepted
            ]
        enc = _encode
        tags = _TAGS
        ecols = prepared.events
        ecols["source_id"] += [sid] * n
        ecols["seq"] += [e.seq for e in accepted]
        ecols["ts"] += [e.ts for e in accepted]
        ecols["kind"] += [tags[type(e)] for e in accepted]
        ecols["request_id"] += [None if type(e) in no_request else e.request_id for e in accepted]
        # A step's fields live in ``steps``; its ``events`` row keeps only its identity.
        ecols["data"] += [None if type(e) is step_cls else enc(e).decode() for e in accepted]
        ecols["ingested_ts"] += [now] * n
        steps = [e for e in accepted if type(e) is step_cls]
        if steps:
            self._prepare_steps(sid, steps, prepared, state, columns)
        if len(steps) < n:
            others = [e for e in accepted if type(e) is not step_cls]
            for e in others:
                if type(e) is ev.Dropped:
                    state.dropped += e.count
            fold_into(prepared.requests, source, others)

    def _prepare_steps(
        self, sid: str, steps: list[ev.Step], prepared: Prepared, state: _SourceState, columns: Columns | None
    ) -> None:
        s = prepared.steps
        first = len(s["seq"])
        for col in STEP_FIELDS:
            s[col] += [getattr(e, col) for e in steps]
        s["source_id"] += [sid] * len(steps)
        s["interval_s"] += [None] * len(steps)  # set by _link_steps once the whole group is in
        state.step_rows += range(first, first + len(steps))
        if columns is not None:  # all of its steps, in seq order: ``steps``
            prepared.step_ids.append(columns)
        else:
            prepared.step_ids += [e.request_ids for e in steps]
            prepared.step_events += [e for e in steps if e.request_ids or e.stalled_request_ids]

    def _link_steps(self, conn: Any, prepared: Prepared, states: dict[str, _SourceState]) -> None:
        """Set ``interval_s`` of the group's steps, and of stored steps whose predecessor is in the group.

        A step's predecessor is the step of its source numbered one less, emitted before it (lower
        seq), at most ``MAX_STEP_GAP_S`` apart. Within one run of an engine, step events are emitted in
        step order, so no step of the source has a seq between a step's and its predecessor's: the
        stored step with the largest seq below a step's is its predecessor or it has none. Hence:

        * in order (the common path), the predecessor is the previous step of the group or the
          source's newest stored step, both in memory: no statement;
        * a step whose predecessor is not in the group nor in memory is looked up in ``steps`` only when
          memory cannot vouch that it was never stored (``_StepMemory``: after a restart, or a write by
          another replica, until a step of the source above the memory's floor is known);
        * a late step (seq at or below the high-water mark: its batch was overtaken) may have a
          successor stored with a NULL interval: one UPDATE sets it, in this transaction.

        So the in-order path costs what it did, and every step whose predecessor is stored ends with
        the same ``interval_s`` whatever the order of arrival.
        """
        links: dict[tuple[str, int], _Link] = {}
        for state in states.values():
            if state.step_rows:
                self._link_source(conn, prepared.steps, state, links)
        if links:
            self._link_successors(conn, list(links.values()))

    def _link_source(
        self, conn: Any, s: dict[str, Any], state: _SourceState, links: dict[tuple[str, int], _Link]
    ) -> None:
        """``_link_steps`` for one source's steps of the group; the stored successors of its late steps
        go to ``links``."""
        col_step, col_seq, col_ts, col_dur = s["step"], s["seq"], s["ts"], s["duration_s"]
        intervals = s["interval_s"]
        rows = state.step_rows
        sid = state.source.id
        mem = self._step_memory.get(sid)
        if mem is None or mem.mark != state.last_seq:  # first sight, restart, or another writer
            mem = self._step_memory[sid] = _StepMemory(mark=state.last_seq, floor=state.last_seq)
        if any(col_seq[a] > col_seq[b] for a, b in itertools.pairwise(rows)):
            rows.sort(key=col_seq.__getitem__)  # batches of the source overtook each other in the group
        ends = mem.ends
        floor = mem.floor
        # Whether a step above ``floor`` with a lower seq than the current one is known (then memory
        # knows the current step's predecessor if it was ever stored).
        vouched = floor < 0
        low = None if vouched else mem.lowest()
        group: dict[int, _StepEnd] = {}
        lookups: list[tuple[int, int, int, float]] = []  # (row, step, seq, ts)
        late: list[int] = []
        mark = state.last_seq
        for i in rows:
            step, seq, ts = col_step[i], col_seq[i], col_ts[i]
            end = ts + col_dur[i]
            prev = group.get(step - 1)
            if prev is None or not _follows(prev, seq, ts):
                prev = ends.get(step - 1)
                if prev is not None and not _follows(prev, seq, ts):
                    prev = None
            if prev is not None:
                intervals[i] = end - prev[2]
            elif not (vouched or (low is not None and low < seq)):
                lookups.append((i, step, seq, ts))
            group[step] = (seq, ts, end)
            if seq > floor:
                vouched = True
            if seq <= mark:
                late.append(i)
        state.step_group = group
        for i, step, seq, ts in lookups:
            found = conn.execute(
                self._PREDECESSOR_SQL, (sid, step - 1, seq, ts - MAX_STEP_GAP_S, ts + MAX_STEP_GAP_S)
            ).fetchall()
            if found:  # fetchall: DuckDB refuses the next statement while a result is unread
                intervals[i] = ts + col_dur[i] - found[0][2]
        for i in late:
            link = mem.successor_link(sid, col_step[i], col_seq[i], col_ts[i], col_dur[i], group)
            if link is not None:
                links[sid, col_step[i] + 1] = link

    def _link_successors(self, conn: Any, links: list[_Link]) -> None:
        """Set the interval of stored steps after late ones: (predecessor's end, source, step, the
        predecessor's seq, ts range)."""
        for params in links:
            conn.execute(self._LINK_SUCCESSOR_SQL, params)

    def _remember_steps(self, prepared: Prepared, states: dict[str, _SourceState]) -> None:
        """After the commit: the group's steps and the new high-water marks into the step memory."""
        s = prepared.steps
        col_step, col_seq, col_ts, col_dur = s["step"], s["seq"], s["ts"], s["duration_s"]
        memory = self._step_memory
        for state in states.values():
            mem = memory.get(state.source.id)
            if mem is None:
                continue  # no steps of it seen by this store yet: the first group with steps starts one
            if mem.mark != state.last_seq:
                # Another writer stored events of it since our last commit, and this group had no steps of
                # it (``_link_steps`` would have started over): what it stored is not in memory.
                mem.floor, mem.low_stale = max(mem.floor, state.last_seq), True
            rows, group = state.step_rows, state.step_group
            if rows:
                ends = mem.ends
                if group is not None and len(group) == len(rows) and ends.keys().isdisjoint(group):
                    ends.update(group)  # the usual case: step numbers not remembered yet, in bulk
                    if not mem.low_stale:
                        floor = mem.floor
                        low = min((v[0] for v in group.values() if v[0] > floor), default=None)
                        if low is not None and (mem.low is None or low < mem.low):
                            mem.low = low
                else:
                    for i in rows:  # in seq order (sorted by _link_steps)
                        ts = col_ts[i]
                        mem.add(col_step[i], (col_seq[i], ts, ts + col_dur[i]))
                mem.prune()
            mem.mark = max(state.last_seq, state.new_last_seq)

    # -- reads ---------------------------------------------------------------------------------
    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))

    # The reads take ``conn``: the API's read connection (``ledger.reads``), else one of the store's.
    def _reading(self, conn: sa.Connection | None) -> Any:
        return contextlib.nullcontext(conn) if conn is not None else self.engine.connect()

    def get_request(self, request_id: str, conn: sa.Connection | None = None) -> dict[str, Any] | None:
        with self._reading(conn) as conn:
            row = conn.execute(
                sa.select(schema.requests).where(schema.requests.c.request_id == request_id)
            ).first()
        return dict(row._mapping) if row is not None else None

    def request_events(self, request_id: str, conn: sa.Connection | None = None) -> list[dict[str, Any]]:
        """The request's timeline: its events from all sources, oldest first."""
        t = schema.events
        with self._reading(conn) as conn:
            rows = conn.execute(
                sa.select(t.c.source_id, t.c.seq, t.c.ts, t.c.kind, t.c.data)
                .where(t.c.request_id == request_id)
                .order_by(t.c.ts, t.c.source_id, t.c.seq)
            ).all()
        out = []
        for source_id, seq, ts, kind, data in rows:
            fields = msgspec.json.decode(data) if data else {}
            for k in ("kind", "seq", "ts", "request_id"):
                fields.pop(k, None)
            out.append({"source_id": source_id, "seq": seq, "ts": ts, "kind": kind, **fields})
        return out

    def source_producer(self, source_id: str) -> tuple[str | None, float | None]:
        """The producer digest ``source_id`` is bound to and when it last sent ((None, None): unknown)."""
        t = schema.sources
        with self.engine.connect() as conn:
            row = conn.execute(
                sa.select(t.c.producer, t.c.last_seen_ts).where(t.c.source_id == source_id)
            ).first()
        return (row[0], row[1]) if row is not None else (None, None)

    def release_producer(self, source_id: str, producer: str) -> None:
        """Unbind ``source_id`` from ``producer`` (when it is still bound to it)."""
        t = schema.sources
        with self.engine.begin() as conn:
            conn.execute(
                sa.update(t).where(t.c.source_id == source_id, t.c.producer == producer).values(producer=None)
            )

    def source_rows(self, conn: sa.Connection | None = None) -> list[dict[str, Any]]:
        with self._reading(conn) as conn:
            rows = conn.execute(sa.select(schema.sources).order_by(schema.sources.c.source_id)).all()
        return [dict(r._mapping) for r in rows]

    def count(self, table: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


class _Stored(NamedTuple):
    """A stored event as the conflict check compares it."""

    kind: str
    ts: float
    request_id: str | None
    data: str | None
    ingested_ts: float


_CLAMPED = ("ts", "first_ts", "arrival_ts")  # the times ``clamp_future`` may set to the receive time


def _accepted_in_group(
    prepared: Prepared, source_id: str, lo: int, hi: int, now: float
) -> dict[int, _Stored]:
    """Events of ``source_id`` accepted earlier in the same group (two copies of a batch in one group)."""
    e = prepared.events
    return {
        s: _Stored(e["kind"][i], e["ts"][i], e["request_id"][i], e["data"][i], now)
        for i, (sid, s) in enumerate(zip(e["source_id"], e["seq"], strict=True))
        if sid == source_id and lo <= s <= hi
    }
