"""Read-only SQL over the ledger: ``POST /v1/sql`` and ``chunkledger query``.

The database enforces "read-only", not string matching. Each backend stacks its own guards:

DuckDB (the service process owns the file; a second in-process instance cannot open it, read-only or
not: DuckDB refuses a second handle on an attached file, so queries run on a new connection to the
service's own instance):

1. DuckDB's parser (``extract_statements``) must find exactly one statement of type SELECT or EXPLAIN;
   DDL, DML, COPY, ATTACH, SET/RESET/PRAGMA, CALL, LOAD/INSTALL, EXPORT and transaction control are
   refused by their statement type, before anything runs.
2. The statement runs in ``BEGIN TRANSACTION READ ONLY``: any write to the ledger (for example
   ``EXPLAIN ANALYZE DELETE``) fails in DuckDB's transaction manager.
3. ``enable_external_access = false`` on the instance (one-way: DuckDB cannot turn it back on while
   running): no file, network or extension access from any SQL (read_csv, read_parquet, glob, URLs).
4. ``python_enable_replacements = false`` on the connection: SQL cannot scan Python objects.
5. DuckDB has no per-table privileges, so the statement's syntax tree (``json_serialize_sql``) may
   not name a table in ``HIDDEN_TABLES`` (credentials) nor call a table function outside
   ``TABLE_FUNCTIONS`` (``query()`` and ``query_table()`` would run SQL no tree shows).
6. A timer calls ``interrupt()`` after ``sql_timeout_s``; rows come from ``fetchmany`` (streamed).

PostgreSQL:

1. The query runs as a dedicated role (``sql_reader_url``; ``grant_reader_role`` creates it with
   SELECT on the ledger tables except ``HIDDEN_TABLES``, and nothing else; the service re-syncs
   those grants at start). A role that is a superuser, may read, write or execute server files, or
   can read a hidden table is refused: a read-only transaction alone does not stop
   ``pg_read_file``, ``lo_import`` or ``COPY TO`` for such a role.
2. ``SET TRANSACTION READ ONLY`` plus ``SET LOCAL statement_timeout``; the transaction is always
   rolled back, so ``set_config`` and friends cannot outlive the query.
3. The query is declared as a server-side cursor (``DECLARE ... CURSOR FOR``), which PostgreSQL only
   accepts for one SELECT/VALUES/TABLE statement without data-modifying WITH; rows are fetched up to
   the cap, never the whole result. EXPLAIN runs on the extended protocol (one statement only).
4. A fresh connection per query (no pool): session state such as advisory locks dies with it.

DuckDB's parser also classifies PostgreSQL SQL first, so that refusals name the statement type; SQL it
cannot parse goes on to PostgreSQL, whose own rules decide.

Values come back JSON-safe: see ``json_value``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import decimal
import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import duckdb
import msgspec
import sqlalchemy as sa

log = logging.getLogger(__name__)

Params = Mapping[str, Any] | None


class SqlError(Exception):
    """A refused or failed query: HTTP ``status``, a short machine ``reason`` and a message for people."""

    def __init__(self, reason: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status

    def as_dict(self) -> dict[str, str]:
        return {"reason": self.reason, "detail": self.message}


@dataclass
class SqlResult:
    columns: list[str]
    types: list[str]
    rows: list[list[Any]]
    truncated: bool
    elapsed_s: float
    truncated_by: str | None = None  # "rows" (max_rows) or "bytes" (sql_max_bytes) when truncated

    def as_dict(self) -> dict[str, Any]:
        return {
            "columns": self.columns,
            "types": self.types,
            "rows": self.rows,
            "truncated": self.truncated,
            "truncated_by": self.truncated_by,
            "elapsed_s": round(self.elapsed_s, 6),
        }


def _value_bytes(v: Any) -> int:
    """About how many bytes a result value takes in the answer."""
    if isinstance(v, (str, bytes)):
        return len(v) + 2
    if isinstance(v, (list, tuple)):
        return 2 + sum(_value_bytes(x) + 1 for x in v)
    if isinstance(v, dict):
        return 2 + sum(len(str(k)) + 4 + _value_bytes(x) for k, x in v.items())
    return 8


def fetch_capped(cur: Any, max_rows: int, max_bytes: int | None) -> tuple[list[Any], str | None]:
    """Rows of an executed cursor up to ``max_rows`` and about ``max_bytes`` of values, fetched in
    chunks (a 10,000-row cap over 50 KB strings must not build a 500 MB answer); (rows, what cut them)."""
    rows: list[Any] = []
    size = 0
    while len(rows) <= max_rows:
        chunk = cur.fetchmany(min(1000, max_rows + 1 - len(rows)))
        if not chunk:
            return rows, None
        if max_bytes is not None:
            for i, row in enumerate(chunk):
                size += 4 + sum(_value_bytes(v) + 1 for v in row)
                if size > max_bytes:
                    rows.extend(chunk[:i])
                    return rows, "bytes"
        rows.extend(chunk)
    return rows[:max_rows], "rows"


# -- statement classification (DuckDB's parser) --------------------------------------------------

_ALLOWED = {"SELECT", "EXPLAIN"}
_REFUSALS = {
    "INSERT": "DML",
    "UPDATE": "DML",
    "DELETE": "DML",
    "MERGE_INTO": "DML",
    "CREATE": "DDL",
    "CREATE_FUNC": "DDL",
    "DROP": "DDL",
    "ALTER": "DDL",
    "COMMENT": "DDL",
    "COPY": "COPY (file access)",
    "COPY_DATABASE": "COPY (file access)",
    "EXPORT": "EXPORT (file access)",
    "ATTACH": "ATTACH (opening another database)",
    "DETACH": "DETACH",
    "SET": "changing settings",
    "VARIABLE_SET": "changing settings",
    "PRAGMA": "PRAGMA (changing settings)",
    "LOAD": "loading extensions",
    "EXTENSION": "loading extensions",
    "TRANSACTION": "transaction control (each query runs in its own read-only transaction)",
    "CALL": "CALL",
    "VACUUM": "maintenance",
    "ANALYZE": "maintenance",
    "PREPARE": "PREPARE",
    "EXECUTE": "EXECUTE",
    "MULTI": "a statement that runs as several statements (e.g. PIVOT without an IN list)",
}

_parser_lock = threading.Lock()
_parser: Any = None


def _statements(sql: str, conn: Any | None) -> list[Any]:
    """DuckDB's parse of ``sql`` (on ``conn``, or a private in-memory instance for PostgreSQL)."""
    global _parser
    if conn is not None:
        return list(conn.extract_statements(sql))
    with _parser_lock:
        if _parser is None:
            _parser = duckdb.connect(":memory:")
        return list(_parser.extract_statements(sql))


def classify(sql: str, conn: Any | None = None, *, strict: bool = True) -> str:
    """``"SELECT"`` or ``"EXPLAIN"``; raises SqlError naming why anything else is refused.

    With ``strict`` False (PostgreSQL), SQL that DuckDB cannot parse is passed as ``"SELECT"``:
    PostgreSQL's own grammar and permissions decide.
    """
    if not sql.strip():
        raise SqlError("empty", "sql is empty: send one SELECT statement")
    try:
        stmts = _statements(sql, conn)
    except duckdb.Error as exc:
        if not strict:
            return "SELECT"
        raise SqlError("syntax", f"syntax error: {_first_line(exc)}") from None
    if not stmts:
        raise SqlError("empty", "sql holds no statement (only comments?): send one SELECT statement")
    if len(stmts) > 1:
        raise SqlError(
            "multiple_statements",
            f"{len(stmts)} statements sent; /v1/sql runs one SELECT per request",
        )
    kind = stmts[0].type.name
    if kind in _ALLOWED:
        return kind
    what = _REFUSALS.get(kind, kind)
    raise SqlError(
        "not_read_only",
        f"{kind} refused: {what} is not allowed; /v1/sql is read-only and runs one SELECT (or EXPLAIN)",
    )


# -- what SQL may read ----------------------------------------------------------------------------

# Tables /v1/sql never reads: they hold credentials (webhook signing secrets and target URLs). On
# PostgreSQL the reader role has no SELECT on them; on DuckDB (no roles) the query's syntax tree is
# checked. Add any table that stores a secret here.
HIDDEN_TABLES = frozenset({"webhook_subscriptions"})

# DuckDB table functions SQL may call. Others are refused: ``query``/``query_table`` run SQL built
# at run time (which no syntax tree shows), ``pragma_storage_info`` shows column min/max values,
# ``checkpoint`` has effects, and the file readers are off anyway (external access).
TABLE_FUNCTIONS = frozenset(
    {
        "range",
        "generate_series",
        "unnest",
        "json_each",
        "json_tree",
        "pragma_table_info",
        "pragma_show",
        "pragma_database_size",
        "pragma_version",
        "pragma_platform",
        "pragma_collations",
        "pg_timezone_names",
        "icu_calendar_names",
        "duckdb_columns",
        "duckdb_constraints",
        "duckdb_databases",
        "duckdb_dependencies",
        "duckdb_functions",
        "duckdb_indexes",
        "duckdb_keywords",
        "duckdb_schemas",
        "duckdb_sequences",
        "duckdb_settings",
        "duckdb_tables",
        "duckdb_types",
        "duckdb_views",
    }
)


def check_duckdb_access(conn: Any, sql: str) -> None:
    """Refuse a SELECT whose syntax tree (DuckDB's ``json_serialize_sql``) reads a hidden table or
    calls a table function outside ``TABLE_FUNCTIONS``. Fails closed: a tree DuckDB cannot give is
    a refusal."""
    try:
        tree = json.loads(conn.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0])
    except (duckdb.Error, ValueError) as exc:
        tree = {"error": True, "error_message": _first_line(exc)}
    if tree.get("error"):
        raise SqlError(
            "permission_denied",
            f"cannot tell which tables this query reads ({tree.get('error_message')}); "
            "write it as a plain SELECT",
        )
    tables: set[str] = set()
    functions: set[str] = set()
    _walk(tree.get("statements"), tables, functions)
    hidden = sorted(tables & HIDDEN_TABLES)
    if hidden:
        raise SqlError(
            "permission_denied", f"{', '.join(hidden)} is not readable through /v1/sql (it holds credentials)"
        )
    banned = sorted(functions - TABLE_FUNCTIONS)
    if banned:
        raise SqlError(
            "permission_denied",
            f"table function {', '.join(banned)} is not allowed in /v1/sql (no files, network or "
            "dynamic SQL; allowed: range, generate_series, unnest, json_each, json_tree, "
            "pragma_table_info, duckdb_* catalog functions)",
        )


def explained_statement(sql: str) -> str:
    """The statement after ``EXPLAIN [ANALYZE] [(options)]``, found with DuckDB's tokenizer."""
    tokens = duckdb.tokenize(sql)
    i = 1
    if i < len(tokens) and sql[tokens[i][0] :].upper().startswith(("ANALYZE", "ANALYSE")):
        i += 1
    if i < len(tokens) and sql[tokens[i][0]] == "(":
        depth = 0
        while i < len(tokens):
            ch = sql[tokens[i][0]]
            depth += (ch == "(") - (ch == ")")
            i += 1
            if depth == 0:
                break
    if i >= len(tokens):
        raise SqlError("syntax", "EXPLAIN needs a statement to explain")
    return sql[tokens[i][0] :]


def _walk(node: Any, tables: set[str], functions: set[str]) -> None:
    if isinstance(node, dict):
        kind = node.get("type")
        if kind == "BASE_TABLE":
            tables.add(str(node.get("table_name", "")).lower())
        elif kind == "TABLE_FUNCTION":
            fn = node.get("function") or {}
            functions.add(str(fn.get("function_name", "")).lower())
        for v in node.values():
            _walk(v, tables, functions)
    elif isinstance(node, list):
        for v in node:
            _walk(v, tables, functions)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- JSON-safe values --------------------------------------------------------------------------


def json_value(v: Any) -> Any:
    """A JSON-safe form of one database value.

    int/str/bool/None as is; finite floats as is, NaN and ±Infinity as null; Decimal as an int when
    integral (PostgreSQL sums) else a float; datetime/date/time as ISO 8601 strings (timezone-aware
    ones with their offset); timedelta as seconds (float); UUID as its string; bytes as base64;
    lists and structs recursively (map keys as strings).
    """
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, decimal.Decimal):
        if not v.is_finite():
            return None
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, dt.timedelta):
        return v.total_seconds()
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(v)).decode()
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    return str(v)


_PLAIN = {"integer", "boolean"}
_TEXT = {"VARCHAR", "TEXT", "CHARACTER VARYING", "BPCHAR", "NAME", "CHAR"}


def _converter(native: str, portable: str) -> Callable[[Any], Any] | None:
    """None where values are already JSON-safe: ints, booleans, text (most ledger columns)."""
    if portable in _PLAIN or re.sub(r"\(.*\)$", "", native.strip()).upper() in _TEXT:
        return None
    return json_value


def _convert_rows(raw: list[Any], natives: list[str], types: list[str]) -> list[list[Any]]:
    convs = [_converter(n, t) for n, t in zip(natives, types, strict=True)]
    if all(c is None for c in convs):
        return [list(r) for r in raw]
    return [[v if c is None else c(v) for v, c in zip(r, convs, strict=True)] for r in raw]


# -- type names ----------------------------------------------------------------------------------

_TYPE_WORDS = [
    (("HUGEINT", "UHUGEINT", "BIGINT", "UBIGINT", "INTEGER", "UINTEGER", "SMALLINT", "USMALLINT"), "integer"),
    (("TINYINT", "UTINYINT", "INT2", "INT4", "INT8", "OID", "INT", "INT64"), "integer"),
    (("DOUBLE", "FLOAT", "REAL", "FLOAT4", "FLOAT8", "DOUBLE PRECISION"), "float"),
    (("DECIMAL", "NUMERIC"), "decimal"),
    (("VARCHAR", "TEXT", "CHAR", "BPCHAR", "NAME", "CHARACTER VARYING", "CHARACTER", "UUID"), "string"),
    (("BOOLEAN", "BOOL"), "boolean"),
    (("TIMESTAMP", "TIMESTAMPTZ", "TIMESTAMP WITH TIME ZONE", "TIMESTAMP_NS", "TIMESTAMP_MS"), "timestamp"),
    (("TIMESTAMP_S", "TIMESTAMP WITHOUT TIME ZONE"), "timestamp"),
    (("DATE",), "date"),
    (("TIME", "TIMETZ", "TIME WITH TIME ZONE", "TIME WITHOUT TIME ZONE"), "time"),
    (("INTERVAL",), "interval"),
    (("JSON", "JSONB"), "json"),
    (("BLOB", "BYTEA"), "blob"),
    (('"NULL"', "NULL", "UNKNOWN"), "null"),
]
_TYPE_MAP = {w: name for words, name in _TYPE_WORDS for w in words}


def type_name(native: str) -> str:
    """The portable name of a DuckDB or PostgreSQL column type.

    integer, float, decimal, string, boolean, timestamp, date, time, interval, json, blob, null,
    list<T>, struct, map; anything else as the database's own name in lower case.
    """
    t = native.strip()
    if t.endswith("[]"):
        return f"list<{type_name(t[:-2])}>"
    upper = re.sub(r"\(.*\)$", "", t).strip().upper()
    if upper in _TYPE_MAP:
        return _TYPE_MAP[upper]
    for prefix, name in (("STRUCT", "struct"), ("MAP", "map"), ("UNION", "struct"), ("ENUM", "string")):
        if upper.startswith(prefix):
            return name
    if upper.startswith("_"):  # PostgreSQL's internal array names
        return f"list<{type_name(upper[1:])}>"
    return t.lower()


# -- runners -------------------------------------------------------------------------------------


class SqlRunner:
    """Runs one read-only statement with a time limit and a row cap; at most ``max_concurrent`` at
    once (each may keep a server thread busy up to the time limit; ingest never waits on them)."""

    dialect = ""
    max_concurrent = 4

    def __init__(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_concurrent)

    def run(
        self,
        sql: str,
        params: Params = None,
        *,
        max_rows: int,
        timeout_s: float,
        max_bytes: int | None = None,
    ) -> SqlResult:
        if not self._slots.acquire(timeout=1.0):
            raise SqlError(
                "busy", f"{self.max_concurrent} SQL queries are already running; retry shortly", 503
            )
        try:
            return self._run(sql, params, max_rows=max_rows, timeout_s=timeout_s, max_bytes=max_bytes)
        finally:
            self._slots.release()

    def _run(
        self, sql: str, params: Params, *, max_rows: int, timeout_s: float, max_bytes: int | None = None
    ) -> SqlResult:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class UnavailableRunner(SqlRunner):
    """A store without SQL (the null:// store): every query is a 503 saying why."""

    def __init__(self, why: str) -> None:
        super().__init__()
        self.why = why

    def _run(
        self, sql: str, params: Params, *, max_rows: int, timeout_s: float, max_bytes: int | None = None
    ) -> SqlResult:
        raise SqlError("unavailable", self.why, status=503)


def _check_params(params: Params) -> dict[str, Any] | None:
    if params is None:
        return None
    for name, value in params.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SqlError("params", f"params: {name!r} is not a parameter name (letters, digits, _)")
        ok = value is None or isinstance(value, (bool, int, float, str))
        if isinstance(value, list):
            ok = all(x is None or isinstance(x, (bool, int, float, str)) for x in value)
        if not ok:
            raise SqlError("params", f"params.{name}: numbers, strings, booleans, null or lists of them")
    return dict(params)


class DuckDBRunner(SqlRunner):
    """Queries on new connections to the service's DuckDB instance (see the module docstring)."""

    dialect = "duckdb"

    def __init__(self, parent: Any) -> None:
        # ``parent`` is a connection of the store's instance, used only to make per-query connections.
        super().__init__()
        self._parent = parent
        self._lock = threading.Lock()
        disable_external_access(parent)

    def _cursor(self) -> Any:
        with self._lock:
            cur = self._parent.cursor()
        cur.execute("SET python_enable_replacements = false")
        cur.execute("SET enable_progress_bar = false")
        return cur

    @contextlib.contextmanager
    def read_transaction(self) -> Iterator[Any]:
        """A connection inside a read-only transaction, rolled back and closed afterwards."""
        cur = self._cursor()
        try:
            cur.execute("BEGIN TRANSACTION READ ONLY")
            yield cur
        finally:
            with contextlib.suppress(duckdb.Error):
                cur.execute("ROLLBACK")
            cur.close()

    def _run(
        self, sql: str, params: Params, *, max_rows: int, timeout_s: float, max_bytes: int | None = None
    ) -> SqlResult:
        bound = _check_params(params)
        with self.read_transaction() as cur:
            inner = sql if classify(sql, cur) == "SELECT" else explained_statement(sql)
            if inner != sql and classify(inner, cur) != "SELECT":  # refuses DML and DDL by name
                raise SqlError("not_read_only", "EXPLAIN explains only a SELECT here")
            check_duckdb_access(cur, inner)
            timer = threading.Timer(timeout_s, cur.interrupt)
            t0 = time.perf_counter()
            timer.start()
            try:
                cur.execute(sql, bound)
                desc = cur.description or []
                raw, cut = fetch_capped(cur, max_rows, max_bytes) if desc else ([], None)
            except duckdb.Error as exc:
                raise _duckdb_error(exc, timeout_s) from None
            except (ValueError, OverflowError, TypeError) as exc:  # a value Python cannot hold
                raise SqlError("query_error", f"a result value could not be read: {exc}") from None
            finally:
                timer.cancel()
            elapsed = time.perf_counter() - t0
        natives = [str(d[1]) for d in desc]
        types = [type_name(n) for n in natives]
        rows = _convert_rows(raw, natives, types)
        return SqlResult([d[0] for d in desc], types, rows, cut is not None, elapsed, cut)

    def close(self) -> None:
        with contextlib.suppress(duckdb.Error):
            self._parent.close()


def disable_external_access(conn: Any) -> None:
    """Turn off file, network and extension access for the whole DuckDB instance (cannot be undone).

    The ledger's write path needs none of it: it appends registered Arrow tables.
    """
    conn.execute("SET autoinstall_known_extensions = false")
    conn.execute("SET autoload_known_extensions = false")
    conn.execute("SET enable_external_access = false")


def _duckdb_error(exc: duckdb.Error, timeout_s: float) -> SqlError:
    msg = _first_line(exc)
    if isinstance(exc, duckdb.InterruptException):
        return SqlError("timeout", f"query stopped at the {timeout_s:g} s time limit (sql_timeout_s)", 408)
    if isinstance(exc, duckdb.PermissionException):
        return SqlError("external_access", f"file and network access is disabled for SQL: {msg}")
    if isinstance(exc, duckdb.TransactionException) and "read-only" in msg:
        return SqlError("not_read_only", f"writes are refused (read-only transaction): {msg}")
    if isinstance(exc, duckdb.ParserException):
        return SqlError("syntax", f"syntax error: {msg}")
    if isinstance(exc, duckdb.OutOfMemoryException):
        return SqlError("resources", f"query ran out of memory: {msg}")
    return SqlError("query_error", msg)


class PostgresRunner(SqlRunner):
    """Queries as the reader role on fresh connections (see the module docstring)."""

    dialect = "postgresql"

    def __init__(self, url: str, *, configured: bool) -> None:
        super().__init__()
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self.configured = configured  # False: falling back to the ledger's own role

    @contextlib.contextmanager
    def read_transaction(self) -> Iterator[Any]:
        """A psycopg connection of the reader role in a read-only transaction, rolled back after."""
        try:
            raw = self.engine.raw_connection()
        except sa.exc.SQLAlchemyError as exc:
            raise SqlError(
                "unavailable",
                f"cannot connect for SQL: {_first_line(getattr(exc, 'orig', None) or exc)}",
                503,
            ) from None
        pg: Any = raw.driver_connection
        try:
            pg.execute("SET TRANSACTION READ ONLY")
            self._check_role(pg)
            yield pg
        finally:
            with contextlib.suppress(Exception):
                pg.rollback()
            raw.close()

    def _check_role(self, pg: Any) -> None:
        role, su, read, write, program = pg.execute(
            "SELECT current_user, rolsuper, "
            "pg_has_role(current_user, 'pg_read_server_files', 'USAGE'), "
            "pg_has_role(current_user, 'pg_write_server_files', 'USAGE'), "
            "pg_has_role(current_user, 'pg_execute_server_program', 'USAGE') "
            "FROM pg_roles WHERE rolname = current_user"
        ).fetchone()
        hidden = pg.execute(
            "SELECT coalesce(array_agg(c.relname::text ORDER BY c.relname), '{}') FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public' "
            "AND c.relname = ANY(%s) AND has_table_privilege(current_user, c.oid, 'SELECT')",
            (sorted(HIDDEN_TABLES),),
        ).fetchone()[0]
        if hidden and not (su or read or write or program):
            raise SqlError(
                "unavailable",
                f"/v1/sql refused: role {role!r} can read {', '.join(hidden)} (credentials); run "
                "`chunkledger sql-reader` again, or use a reader role without SELECT on it",
                503,
            )
        if su or read or write or program:
            what = "a superuser" if su else "allowed to read, write or run server files"
            where = (
                "CHUNKLEDGER_SQL_READER_URL names"
                if self.configured
                else "no CHUNKLEDGER_SQL_READER_URL; the ledger's"
            )
            raise SqlError(
                "unavailable",
                f"/v1/sql refused: {where} role {role!r} is {what}; configure CHUNKLEDGER_SQL_READER_URL "
                "with a read-only role (create one with `chunkledger sql-reader`)",
                503,
            )

    def _run(
        self, sql: str, params: Params, *, max_rows: int, timeout_s: float, max_bytes: int | None = None
    ) -> SqlResult:
        import psycopg

        bound = _check_params(params)
        kind = classify(sql, strict=False)
        query = _pg_placeholders(sql) if bound is not None else sql
        with self.read_transaction() as pg:
            pg.execute(f"SET LOCAL statement_timeout = {max(1, int(timeout_s * 1000))}")
            t0 = time.perf_counter()
            try:
                if kind == "EXPLAIN":
                    cur = pg.cursor()
                    cur.execute(query, bound, binary=True)  # extended protocol: one statement only
                else:
                    cur = pg.cursor(name="chunkledger_sql")
                    cur.execute(query, bound)
                desc = cur.description or []
                raw, cut = fetch_capped(cur, max_rows, max_bytes) if desc else ([], None)
            except psycopg.Error as exc:
                raise _pg_error(exc, timeout_s) from None
            except (ValueError, OverflowError, TypeError) as exc:  # a value Python cannot hold
                raise SqlError("query_error", f"a result value could not be read: {exc}") from None
            elapsed = time.perf_counter() - t0
        natives = [d.type_display for d in desc]
        types = [type_name(n) for n in natives]
        rows = _convert_rows(raw, natives, types)
        return SqlResult([d.name for d in desc], types, rows, cut is not None, elapsed, cut)

    def close(self) -> None:
        self.engine.dispose()


def _pg_placeholders(sql: str) -> str:
    """``$name`` parameters (DuckDB's syntax) as psycopg's ``%(name)s``; other ``%`` doubled.

    DuckDB's tokenizer finds the ``$`` operators followed by an identifier, so ``$`` inside string
    literals and comments is left alone.
    """
    tokens = duckdb.tokenize(sql)
    spots: list[tuple[int, int, str]] = []
    for (pos, kind), nxt in zip(tokens, [*tokens[1:], None], strict=True):
        if kind.name == "operator" and sql[pos] == "$" and nxt is not None and nxt[0] == pos + 1:
            m = re.match(r"[A-Za-z_][A-Za-z0-9_]*", sql[pos + 1 :])
            if m:
                spots.append((pos, pos + 1 + m.end(), m.group()))
    out, last = [], 0
    for start, end, name in spots:
        out.append(sql[last:start].replace("%", "%%"))
        out.append(f"%({name})s")
        last = end
    out.append(sql[last:].replace("%", "%%"))
    return "".join(out)


def _pg_error(exc: Any, timeout_s: float) -> SqlError:
    state = getattr(exc, "sqlstate", None) or ""
    msg = _first_line(exc)
    if state == "57014":
        return SqlError("timeout", f"query stopped at the {timeout_s:g} s time limit (sql_timeout_s)", 408)
    if state in ("25006", "25001") or (state == "0A000" and "data-modifying" in msg):
        return SqlError("not_read_only", f"writes are refused (read-only transaction): {msg}")
    if state == "42501":
        return SqlError("permission_denied", f"permission denied (SQL may only read ledger tables): {msg}")
    if state == "42601" and "multiple commands" in msg:
        return SqlError("multiple_statements", "more than one statement; /v1/sql runs exactly one SELECT")
    if state == "42601":
        return SqlError("syntax", f"syntax error (one SELECT, VALUES or TABLE statement, or EXPLAIN): {msg}")
    if state.startswith("53"):
        return SqlError("resources", f"query ran out of resources: {msg}")
    if state.startswith("08") or state == "":
        return SqlError("unavailable", f"database connection failed: {msg}", 503)
    return SqlError("query_error", msg)


def open_runner(store: Any, *, reader_url: str = "") -> SqlRunner:
    """The SQL runner for a store (its DuckDB instance, or PostgreSQL as the reader role)."""
    dialect = getattr(store, "dialect", "")
    if dialect == "duckdb":
        return DuckDBRunner(store.reader_connection())
    if dialect == "postgresql":
        if reader_url:
            sync_reader_grants(store.engine, reader_url)
        url = reader_url or store.engine.url.render_as_string(hide_password=False)
        return PostgresRunner(url, configured=bool(reader_url))
    return UnavailableRunner(f"this ledger's store ({type(store).__name__}) keeps no tables to query")


# -- the PostgreSQL reader role ------------------------------------------------------------------


def grant_reader_role(
    engine: sa.Engine, role: str = "chunkledger_reader", password: str | None = None
) -> None:
    """Create (or update) a login role that may only SELECT the ledger's tables and views.

    Run it as the role that owns the ledger tables (the one the service connects with), so that
    tables and views later migrations create are readable too (ALTER DEFAULT PRIVILEGES).
    """
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", role):
        raise ValueError(f"role: {role!r} is not a plain lower-case PostgreSQL name")
    with engine.begin() as conn:
        exists = conn.execute(sa.text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first()
        verb = "ALTER" if exists else "CREATE"
        attrs = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"
        stmt = f"{verb} ROLE {role} {attrs}"
        if password is not None:
            stmt += " PASSWORD " + conn.exec_driver_sql("SELECT quote_literal(%s)", (password,)).scalar_one()
        conn.exec_driver_sql(stmt)
        db = conn.exec_driver_sql("SELECT current_database()").scalar_one()
        conn.exec_driver_sql(f'GRANT CONNECT ON DATABASE "{db}" TO {role}')
        conn.exec_driver_sql(f"GRANT USAGE ON SCHEMA public TO {role}")
        conn.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        conn.exec_driver_sql(f"ALTER DEFAULT PRIVILEGES IN SCHEMA public GRANT SELECT ON TABLES TO {role}")
        _revoke_hidden(conn, role)


def _revoke_hidden(conn: Any, role: str) -> None:
    for table in sorted(HIDDEN_TABLES):
        if conn.exec_driver_sql("SELECT to_regclass(%s)", (f"public.{table}",)).scalar_one() is not None:
            conn.exec_driver_sql(f"REVOKE ALL ON public.{table} FROM {role}")


def sync_reader_grants(engine: sa.Engine, reader: str) -> None:
    """At service start (PostgreSQL, reader configured): SELECT on every ledger table and view for the
    reader role, none on ``HIDDEN_TABLES``; so tables and views a migration (re)created are readable.
    Best effort: a role that may not grant only logs why."""
    role = sa.engine.make_url(reader).username or ""
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", role):
        log.warning("sql reader role %r is not a plain name; grants not synced", role)
        return
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
            _revoke_hidden(conn, role)
    except sa.exc.SQLAlchemyError as exc:
        log.warning(
            "could not sync the SQL reader's grants: %s", _first_line(getattr(exc, "orig", None) or exc)
        )


def reader_url(url: str, role: str, password: str | None = None) -> str:
    """``url`` with the reader role's name (and password) in place of the owner's."""
    parsed = sa.engine.make_url(url).set(username=role, password=password)
    return parsed.render_as_string(hide_password=False)


def dumps(obj: Any) -> bytes:
    """Compact JSON; values must already be JSON-safe (``json_value``)."""
    return _encode(obj)


_encode = msgspec.json.Encoder().encode


# -- output formats (API CSV and the ``chunkledger query`` console) -------------------------------


def csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, dict)):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    return v


def to_csv(columns: list[str], rows: list[list[Any]]) -> str:
    """RFC 4180 CSV with a header row; NULL as an empty field, lists and structs as JSON."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for row in rows:
        w.writerow([csv_cell(v) for v in row])
    return buf.getvalue()


_NUMERIC = {"integer", "float", "decimal"}


def _cell(v: Any, width: int) -> str:
    if v is None:
        text = "NULL"
    elif isinstance(v, bool):
        text = "true" if v else "false"
    elif isinstance(v, float):
        text = f"{v:.6f}".rstrip("0").rstrip(".") if abs(v) >= 1e-6 or v == 0 else f"{v:.3g}"
    elif isinstance(v, (list, dict)):
        text = json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    else:
        text = str(v)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def to_table(columns: list[str], types: list[str], rows: list[list[Any]], *, width: int = 60) -> str:
    """Aligned columns for a terminal: numbers right-aligned, floats to 6 decimals, long cells cut."""
    cells = [[_cell(v, width) for v in row] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    right = [t in _NUMERIC for t in types]

    def line(values: list[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True)]
        return " | ".join(parts).rstrip()

    out = [line(columns), "-+-".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def parse_param(text: str) -> tuple[str, Any]:
    """``name=value`` with the value read as JSON when it parses (numbers, true, null), else a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--param {text!r}: expected name=value")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return name, value
