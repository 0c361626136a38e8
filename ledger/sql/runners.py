"""The runners: DuckDB (a connection to the service's own instance) and PostgreSQL (the reader role),
each with its own guards (see the package docstring)."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import duckdb
import sqlalchemy as sa

from ledger.config import Settings
from ledger.reads import pg_read_limits, pg_session_limits
from ledger.sql.base import Params, SqlError, SqlResult, fetch_capped
from ledger.sql.guard import HIDDEN_TABLES, check_duckdb_access, classify, explained_statement, first_line
from ledger.sql.roles import sync_reader_grants
from ledger.sql.values import convert_rows, type_name

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
        if not self._slots.acquire(blocking=False):  # refused at once: no thread waits for a slot
            raise SqlError(
                "busy", f"{self.max_concurrent} SQL queries are already running; retry shortly", 429
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
        rows = convert_rows(raw, natives, types)
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
    msg = first_line(exc)
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

    def __init__(self, url: str, *, configured: bool, session_limits: dict[str, str] | None = None) -> None:
        super().__init__()
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self.configured = configured  # False: falling back to the ledger's own role
        if session_limits:
            sa.event.listen(
                self.engine, "connect", lambda dbapi, _rec: pg_session_limits(dbapi, session_limits)
            )

    @contextlib.contextmanager
    def read_transaction(self) -> Iterator[Any]:
        """A psycopg connection of the reader role in a read-only transaction, rolled back after."""
        try:
            raw = self.engine.raw_connection()
        except sa.exc.SQLAlchemyError as exc:
            raise SqlError(
                "unavailable",
                f"cannot connect for SQL: {first_line(getattr(exc, 'orig', None) or exc)}",
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
        rows = convert_rows(raw, natives, types)
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
    msg = first_line(exc)
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


def open_runner(store: Any, *, reader_url: str = "", settings: Settings | None = None) -> SqlRunner:
    """The SQL runner for a store (its DuckDB instance, or PostgreSQL as the reader role). ``settings``:
    PostgreSQL sessions get the read connections' limits (``ledger.reads``; the time limit stays
    ``sql_timeout_s``, set per query)."""
    dialect = getattr(store, "dialect", "")
    if dialect == "duckdb":
        return DuckDBRunner(store.reader_connection())
    if dialect == "postgresql":
        if reader_url:
            sync_reader_grants(store.engine, reader_url)
        url = reader_url or store.engine.url.render_as_string(hide_password=False)
        limits = pg_read_limits(settings) if settings is not None else {}
        limits.pop("statement_timeout", None)
        return PostgresRunner(url, configured=bool(reader_url), session_limits=limits)
    return UnavailableRunner(f"this ledger's store ({type(store).__name__}) keeps no tables to query")
