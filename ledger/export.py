"""Parquet export of a time window of the ledger: ``chunkledger export`` and ``GET /v1/export/...``.

Tables and the window each applies to (``since <= t < until``; either end may be open):

* ``requests`` (the view, attribution columns included): requests that started in the window
  (``start_ts``), so consecutive windows split requests without overlap;
* ``steps`` and ``events``: rows whose ``ts`` falls in the window (source wall clock);
* ``sources``: every source (a small table to join on).

Rows stream from the database as Arrow record batches (DuckDB's Arrow reader; PostgreSQL's
server-side cursor) into one Parquet row group per batch, so memory stays flat whatever the window.
Column types are the same from both backends: int64, double, string, list<string>.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from msgspec import UNSET, UnsetType

from ledger import schema
from ledger.records import Record, as_json

TABLES = ("requests", "steps", "events", "sources")
WINDOW_COLUMN = {"requests": "start_ts", "steps": "ts", "events": "ts", "sources": None}
BATCH_ROWS = 65_536

# Steps go out with their requests' ids (``request_ids``, as the engine sent them), not the ledger's
# internal keys, so an export stands on its own.
_COLUMNS = {
    "steps": ", ".join(c.name for c in schema.steps.columns if c.name != "request_keys")
    + f", {schema.step_request_ids_sql()} AS request_ids"
}
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_time(text: str | float, *, field: str = "since", now: float | None = None) -> float:
    """Unix seconds from ISO 8601 (UTC unless it says otherwise), unix seconds, or an age (``90s``,
    ``15m``, ``1h``, ``2d``, ``1w``: that long before ``now``); ``now`` itself is accepted too."""
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip()
    now = time.time() if now is None else now
    if s.lower() == "now":
        return now
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smhdw])", s.lower())
    if m:
        return now - float(m.group(1)) * _UNITS[m.group(2)]
    with contextlib.suppress(ValueError):
        return float(s)
    try:
        when = dt.datetime.fromisoformat(s.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{field}: {text!r} is not a time; use ISO 8601 (2026-12-01T00:00Z), "
            "unix seconds, or an age such as 90s, 15m, 1h, 2d"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


@dataclass(frozen=True)
class Window:
    since: float | None = None
    until: float | None = None

    def __post_init__(self) -> None:
        if self.since is not None and self.until is not None and self.until <= self.since:
            raise ValueError(f"until ({self.until}) must be after since ({self.since})")

    def record(self) -> ExportedWindow:
        def iso(t: float | None) -> str | None:
            return None if t is None else dt.datetime.fromtimestamp(t, dt.UTC).isoformat()

        return ExportedWindow(
            since=self.since, until=self.until, since_iso=iso(self.since), until_iso=iso(self.until)
        )


class ExportedWindow(Record):
    """The window exported: unix seconds (null: open) and the same in ISO 8601, UTC."""

    since: float | None
    until: float | None
    since_iso: str | None
    until_iso: str | None


class ExportedTable(Record):
    """One table's file in the export folder."""

    file: str
    rows: int
    bytes: int

    @classmethod
    def of(cls, path: Path, rows: int) -> ExportedTable:
        return cls(file=path.name, rows=rows, bytes=path.stat().st_size)


class Manifest(Record):
    """``manifest.json``: the window, when, from where (a database, its password hidden, or the ledger
    it was exported through) and each table's file."""

    window: ExportedWindow
    exported_at: float
    source: str | UnsetType = UNSET
    tables: dict[str, ExportedTable] = {}


def table_sql(table: str, window: Window, *, style: str) -> tuple[str, dict[str, float]]:
    """The SELECT for one table and window; parameters as ``$name`` (duckdb) or ``%(name)s`` (pg)."""
    if table not in WINDOW_COLUMN:
        raise ValueError(f"table: {table!r} is not exported; one of {', '.join(TABLES)}")
    col = WINDOW_COLUMN[table]
    where, params = [], {}
    for name, op in (("since", ">="), ("until", "<")):
        value = getattr(window, name)
        if col is not None and value is not None:
            where.append(f"{col} {op} " + (f"${name}" if style == "duckdb" else f"%({name})s"))
            params[name] = value
    order = " ORDER BY source_id" if table == "sources" else ""
    return f"SELECT {_COLUMNS.get(table, '*')} FROM {table}" + (
        " WHERE " + " AND ".join(where) if where else ""
    ) + order, params


# -- Arrow batches from each backend -------------------------------------------------------------


def _plain_type(t: pa.DataType) -> pa.DataType:
    """One Arrow type per column whatever the backend (list child names, string flavours, decimals)."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return pa.list_(_plain_type(t.value_type))
    if pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_decimal(t):
        return pa.float64()
    if pa.types.is_integer(t) and not pa.types.is_uint64(t):
        return pa.int64()
    return t


def _plain_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f.name, _plain_type(f.type)) for f in schema])


def duckdb_batches(conn: Any, sql: str, params: dict[str, Any]) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    reader = conn.sql(sql, params=params or None).to_arrow_reader(BATCH_ROWS)
    schema = _plain_schema(reader.schema)

    def gen() -> Iterator[pa.RecordBatch]:
        for batch in reader:
            yield batch if batch.schema == schema else batch.cast(schema)

    return schema, gen()


_PG_ARROW = {
    "int8": pa.int64(),
    "int4": pa.int64(),
    "int2": pa.int64(),
    "float8": pa.float64(),
    "float4": pa.float64(),
    "numeric": pa.float64(),
    "text": pa.string(),
    "varchar": pa.string(),
    "bool": pa.bool_(),
    "timestamptz": pa.timestamp("us", tz="UTC"),
    "timestamp": pa.timestamp("us"),
}


def _pg_type(display: str) -> pa.DataType:
    base = re.sub(r"\(.*\)", "", display)
    if base.endswith("[]"):
        return pa.list_(_pg_type(base[:-2]))
    return _PG_ARROW.get(base, pa.string())


def _pg_column(values: list[Any], t: pa.DataType) -> pa.Array:
    if t == pa.string():
        values = [v if v is None or isinstance(v, str) else json.dumps(v, default=str) for v in values]
    elif t == pa.float64():
        values = [None if v is None else float(v) for v in values]
    return pa.array(values, type=t)


def pg_batches(pg: Any, sql: str, params: dict[str, Any]) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Batches from a server-side cursor on ``pg`` (a psycopg connection inside a transaction)."""
    cur = pg.cursor(name="chunkledger_export")
    cur.itersize = BATCH_ROWS
    cur.execute(sql, params or None)
    schema = pa.schema([pa.field(d.name, _pg_type(d.type_display)) for d in cur.description])

    def gen() -> Iterator[pa.RecordBatch]:
        while rows := cur.fetchmany(BATCH_ROWS):
            cols = list(zip(*rows, strict=True))
            yield pa.record_batch(
                [_pg_column(list(c), f.type) for c, f in zip(cols, schema, strict=True)], schema
            )
        cur.close()

    return schema, gen()


def table_batches(
    conn: Any, dialect: str, table: str, window: Window
) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Schema and record batches of one table's window over an open read connection."""
    if dialect == "duckdb":
        sql, params = table_sql(table, window, style="duckdb")
        return duckdb_batches(conn, sql, params)
    sql, params = table_sql(table, window, style="pg")
    return pg_batches(conn, sql, params)


# -- read connections ----------------------------------------------------------------------------


@contextlib.contextmanager
def pg_read_transaction(engine: Any) -> Iterator[Any]:
    """A psycopg connection from ``engine`` in a read-only, repeatable-read transaction (one snapshot
    for all tables), rolled back afterwards."""
    raw = engine.raw_connection()
    pg = raw.driver_connection
    try:
        pg.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield pg
    finally:
        with contextlib.suppress(Exception):
            pg.rollback()
        raw.close()


class LedgerLocked(RuntimeError):
    pass


@contextlib.contextmanager
def direct_connection(db_url: str) -> Iterator[tuple[Any, str]]:
    """(read connection, dialect) on the database itself, for when the service is not running."""
    if db_url.startswith("duckdb"):
        import duckdb
        import sqlalchemy as sa

        path = sa.engine.make_url(db_url).database or ":memory:"
        if path != ":memory:" and not Path(path).exists():
            raise FileNotFoundError(f"no ledger database at {path}")
        try:
            conn = duckdb.connect(path, read_only=True)
        except duckdb.IOException as exc:
            raise LedgerLocked(
                f"cannot open {path}: {str(exc).splitlines()[0]}; while `chunkledger serve` holds the file, "
                "export through it (--ledger URL) instead of --db"
            ) from None
        try:
            conn.execute("BEGIN TRANSACTION")
            yield conn, "duckdb"
        finally:
            conn.close()
        return
    import sqlalchemy as sa

    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        with pg_read_transaction(engine) as pg:
            yield pg, "postgresql"
    finally:
        engine.dispose()


# -- Parquet -------------------------------------------------------------------------------------


def write_parquet(schema: pa.Schema, batches: Iterator[pa.RecordBatch], path: Path) -> int:
    """Write ``batches`` to ``path`` (via a temporary file, renamed at the end); the row count."""
    tmp = path.with_name(path.name + ".part")
    rows = 0
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for batch in batches:
                writer.write_batch(batch)
                rows += batch.num_rows
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return rows


class _Sink:
    """A write-only file for ParquetWriter whose bytes are taken out as they come."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.pos = 0
        self.closed = False

    def write(self, data: Any) -> int:
        b = bytes(data)
        self.chunks.append(b)
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True

    def take(self) -> bytes:
        out = b"".join(self.chunks)
        self.chunks.clear()
        return out


def parquet_stream(schema: pa.Schema, batches: Iterator[pa.RecordBatch]) -> Iterator[bytes]:
    """A Parquet file as a byte stream: one row group per batch, the footer last."""
    sink = _Sink()
    with pq.ParquetWriter(pa.PythonFile(sink, mode="w"), schema, compression="zstd") as writer:
        for batch in batches:
            writer.write_batch(batch)
            if data := sink.take():
                yield data
    if data := sink.take():
        yield data


def export_dir(
    conn: Any, dialect: str, window: Window, out: Path, tables: tuple[str, ...] = TABLES
) -> Manifest:
    """Write ``out/<table>.parquet`` for each table and ``out/manifest.json``; the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(window=window.record(), exported_at=time.time())
    for table in tables:
        schema, batches = table_batches(conn, dialect, table, window)
        path = out / f"{table}.parquet"
        manifest.tables[table] = ExportedTable.of(path, write_parquet(schema, batches, path))
    write_manifest(out, manifest)
    return manifest


def write_manifest(out: Path, manifest: Manifest) -> None:
    (out / "manifest.json").write_text(json.dumps(as_json(manifest), indent=2) + "\n")
