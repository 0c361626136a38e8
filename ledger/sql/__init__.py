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

Modules: ``guard`` (what SQL may run), ``runners`` (DuckDB and PostgreSQL), ``roles`` (the PostgreSQL
reader role), ``values`` (JSON-safe values, type names, output formats), ``base`` (error, result,
capped fetch); the commands (``chunkledger query`` and ``sql-reader``) are ``chunkledger.sql``. The
package's names load on first use (PEP 562), so that the command line's help loads no database
library.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SqlError": "base",
    "SqlResult": "base",
    "fetch_capped": "base",
    "HIDDEN_TABLES": "guard",
    "TABLE_FUNCTIONS": "guard",
    "classify": "guard",
    "check_duckdb_access": "guard",
    "SqlRunner": "runners",
    "DuckDBRunner": "runners",
    "PostgresRunner": "runners",
    "UnavailableRunner": "runners",
    "open_runner": "runners",
    "_pg_placeholders": "runners",
    "grant_reader_role": "roles",
    "sync_reader_grants": "roles",
    "reader_url": "roles",
    "json_value": "values",
    "type_name": "values",
    "dumps": "values",
    "to_csv": "values",
    "to_table": "values",
    "parse_param": "values",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ledger.sql' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ledger.sql.{module}"), name)


__all__ = [name for name in _EXPORTS if not name.startswith("_")]
