"""What SQL may run: one SELECT or EXPLAIN (DuckDB's parser), naming no hidden table and calling no
table function outside an allow-list (the statement's syntax tree)."""

from __future__ import annotations

import json
import threading
from typing import Any

import duckdb

from ledger.sql.base import SqlError

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
        raise SqlError("syntax", f"syntax error: {first_line(exc)}") from None
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
        tree = {"error": True, "error_message": first_line(exc)}
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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
