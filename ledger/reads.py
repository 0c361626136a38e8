"""The read routes' database connections, apart from ingest's, each with a time and memory budget.

Ingest owns the store's engine (PostgreSQL: its pool; DuckDB: the writer connection). Reads (analytics,
request pages, advice, what-if, Parquet export) never take from it:

* PostgreSQL: an engine of their own, two connections per read slot (``read_max_concurrent``), each session
  set up with ``statement_timeout`` (``read_timeout_s``), ``idle_in_transaction_session_timeout``
  (``send_timeout_s`` + 10 s: a backstop should the service itself stall), ``work_mem``,
  ``temp_file_limit`` and ``jit = off``. No read load can exhaust the writer's, the rule ticker's or
  the webhook worker's pool.
* DuckDB: connections to the store's one instance (a second instance cannot open the file). DuckDB has
  no per-connection memory limit, so the instance's ``memory_limit``, ``threads`` and
  ``max_temp_directory_size`` are set here; a read past its time is interrupted.

Errors the budgets cause are :class:`~ledger.refusal.Refusal` (408 ``timeout``, 400 ``resources``), which
the API answers with its one error body, never a 500.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa

from ledger.config import Settings
from ledger.export import pg_read_transaction
from ledger.refusal import Refusal

log = logging.getLogger(__name__)

_warned: set[str] = set()


def pg_session_limits(pg: Any, limits: dict[str, str]) -> None:
    """``SET`` each of ``limits`` on a fresh psycopg connection (outside any transaction). One the role
    may not set (``temp_file_limit`` needs a superuser or ``GRANT SET ON PARAMETER``) is logged once and
    left at the server's value."""
    autocommit = pg.autocommit
    pg.autocommit = True
    try:
        for name, value in limits.items():
            try:
                pg.execute(f"SET {name} = '{value}'")
            except Exception as exc:  # psycopg.errors.InsufficientPrivilege, most likely
                if name not in _warned:
                    _warned.add(name)
                    log.warning(
                        "could not set %s = %s on read connections (%s); it stays at the server's value: "
                        "a superuser can ALTER ROLE ... SET %s, or GRANT SET ON PARAMETER %s",
                        name,
                        value,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                        name,
                        name,
                    )
    finally:
        pg.autocommit = autocommit


def pg_read_limits(settings: Settings) -> dict[str, str]:
    """The session settings of every PostgreSQL read connection (reads, export, SQL)."""
    return {
        "statement_timeout": f"{max(1, int(settings.read_timeout_s * 1000))}",
        "idle_in_transaction_session_timeout": f"{int((settings.send_timeout_s + 10) * 1000)}",
        "work_mem": settings.read_work_mem.replace(" ", ""),
        "temp_file_limit": settings.read_temp_file_limit.replace(" ", ""),
        # LLVM compiling a statement whose estimated cost passes jit_above_cost: the requests view's
        # estimates are large, so attribution over 100k requests spent 2.7 of its 2.8 s compiling
        # (0.09 s without). The writer keeps JIT: its merges ran 7-11 % faster with it (bench.ingest).
        "jit": "off",
    }


_niced = threading.local()


def read_priority(nice: int) -> None:
    """Run the calling thread (one that runs reads) ``nice`` steps nicer, once per thread.

    Linux keeps a nice value per thread, inherited by the threads it starts, and an unprivileged
    process cannot take it back: the thread stays a read thread. Ingest (the event loop, its own pool,
    the writer) keeps the process's priority, so under read load the scheduler gives the writer the
    CPU first instead of a share beside every running query (on 2 cores, 8 heavy queries took the
    normal source's ack p99 past a second)."""
    if not nice or getattr(_niced, "done", False):
        return
    _niced.done = True
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError) as exc:  # not Linux, or a sandbox without setpriority
        if "nice" not in _warned:
            _warned.add("nice")
            log.warning(
                "could not lower the read threads' priority (%s); reads share the CPU with ingest", exc
            )


def duckdb_instance_limits(conn: Any, settings: Settings) -> None:
    """The DuckDB instance's memory, threads and spill limits (instance-wide: DuckDB has no other).

    Its helper threads (``threads`` - 1) are started again from a read thread (``read_priority``), so
    that a query's parallel work runs at the reads' priority, not the writer's."""
    conn.execute(f"SET memory_limit = '{settings.duckdb_memory_limit}'")
    conn.execute(f"SET max_temp_directory_size = '{settings.duckdb_max_temp_directory_size}'")

    def start_threads() -> None:
        read_priority(settings.read_nice)
        conn.execute("SET threads = 1")  # stops the helpers started at the instance's opening
        conn.execute(f"SET threads = {settings.duckdb_threads}")

    starter = threading.Thread(target=start_threads, name="chunkledger-duckdb-threads")
    starter.start()
    starter.join()


def refusal_for(exc: BaseException, settings: Settings) -> Refusal | None:
    """The budget a database error says was spent, as a refusal naming it; None for other errors."""
    orig = getattr(exc, "orig", None) or exc
    name = type(orig).__name__
    state = getattr(orig, "sqlstate", None) or ""
    text = str(orig).splitlines()[0] if str(orig) else name
    if name == "InterruptException" or state == "57014":
        return Refusal(
            "timeout",
            f"the read stopped at its {settings.read_timeout_s:g} s time limit (read_timeout_s); narrow "
            "the window",
            status=408,
            limit="read_timeout_s",
        )
    if name == "OutOfMemoryException" or state.startswith("53"):
        limit = "duckdb_memory_limit" if name == "OutOfMemoryException" else "read_temp_file_limit"
        return Refusal(
            "resources",
            f"the read needs more memory or temporary space than this ledger allows ({limit}): {text}",
            status=400,
            limit=limit,
        )
    return None


class Reads:
    """The read side's connections for one app (see the module docstring)."""

    def __init__(self, store: Any, settings: Settings) -> None:
        self.settings = settings
        self.dialect: str = getattr(store, "dialect", "")
        self.engine: sa.Engine | None = None
        self._own_engine = False
        self._parent: Any = None
        if self.dialect == "postgresql":
            limits = pg_read_limits(settings)
            url = store.engine.url.render_as_string(hide_password=False)
            self.engine = sa.create_engine(
                url,
                pool_size=settings.read_max_concurrent,
                max_overflow=settings.read_max_concurrent,  # a read may hold two at once (advice, what-if)
                pool_timeout=5,
                pool_pre_ping=True,
            )
            sa.event.listen(self.engine, "connect", lambda dbapi, _rec: pg_session_limits(dbapi, limits))
            self._own_engine = True
        elif self.dialect == "null":
            self.engine = store.engine  # an empty in-memory DuckDB: reads find nothing
        elif self.dialect == "duckdb":
            self.engine = store.engine
            # A connection of the instance made now, before the writer runs, only to make cursors from
            # (under the lock): a cursor made from the writer's own connection while it writes breaks it.
            self._parent = store.reader_connection()
            self._lock = threading.Lock()
            duckdb_instance_limits(self._parent, settings)

    @contextlib.contextmanager
    def budget_errors(self) -> Iterator[None]:
        """Database errors a budget caused, raised as the refusal naming it (others as they are)."""
        try:
            yield
        except sa.exc.DBAPIError as exc:
            refusal = refusal_for(exc, self.settings)
            if refusal is None:
                raise
            raise refusal from None

    @contextlib.contextmanager
    def connect(self) -> Iterator[sa.Connection]:
        """A read connection whose statements stop at ``read_timeout_s``; budget errors as refusals."""
        if self.engine is None:
            raise Refusal("no_database", "this ledger's store keeps no tables to read", status=409)
        read_priority(self.settings.read_nice)
        with self.budget_errors(), self.engine.connect() as conn:
            timer = None
            if self.dialect == "duckdb":
                duck: Any = conn.connection.driver_connection
                timer = threading.Timer(self.settings.read_timeout_s, duck.interrupt)
                timer.start()
            try:
                yield conn
            finally:
                if timer is not None:
                    timer.cancel()

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Any]:
        """A driver connection in a read-only transaction (one snapshot for a whole export), rolled
        back and released afterwards: a psycopg connection of the read pool, or a DuckDB cursor."""
        read_priority(self.settings.read_nice)
        if self.dialect == "duckdb":
            with self._lock:
                cur = self._parent.cursor()
            try:
                cur.execute("SET python_enable_replacements = false")
                cur.execute("BEGIN TRANSACTION READ ONLY")
                yield cur
            finally:
                with contextlib.suppress(Exception):
                    cur.execute("ROLLBACK")
                cur.close()
            return
        if self.engine is None:
            raise Refusal("no_database", "this ledger's store keeps no tables to export", status=503)
        with pg_read_transaction(self.engine) as pg:
            yield pg

    def close(self) -> None:
        if self._own_engine and self.engine is not None:
            self.engine.dispose()
        if self._parent is not None:
            with contextlib.suppress(Exception):
                self._parent.close()
