"""``chunkledger query`` and ``chunkledger sql-reader``: read-only SQL from a terminal.

The SQL itself runs in the ledger (the rest of ``ledger.sql``); this module only holds the commands and
imports the rest when one runs, so that the command line's help loads neither DuckDB nor SQLAlchemy.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import typer

from chunkledger.options import LedgerUrlOpt, ReadTokenOpt
from ledger.defaults import DEFAULT_LEDGER_URL


def query_command(
    sql: Annotated[str, typer.Argument(help="one SELECT statement ('-' reads it from stdin)")],
    format: Annotated[
        Literal["table", "csv", "json"], typer.Option("--format", "-f", help="table, csv or json")
    ] = "table",
    ledger: LedgerUrlOpt = DEFAULT_LEDGER_URL,
    token: ReadTokenOpt = None,
    max_rows: Annotated[
        int | None, typer.Option("--max-rows", min=1, help="row cap (default: ledger's)")
    ] = None,
    param: Annotated[
        list[str] | None, typer.Option("--param", "-p", help="name=value for a $name placeholder; repeatable")
    ] = None,
) -> None:
    """Run read-only SQL on a running ledger (tables: requests, steps, events, sources)."""
    import sys

    from ledger.sql.values import parse_param, to_csv, to_table

    if sql == "-":
        sql = sys.stdin.read()
    body: dict[str, Any] = {"sql": sql}
    try:
        if param:
            body["params"] = dict(parse_param(p) for p in param)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if max_rows is not None:
        body["max_rows"] = max_rows
    from chunkledger.errors import exit_for
    from ledger.client import LedgerClient, LedgerError

    try:
        with LedgerClient(ledger, token, timeout_s=3600.0) as client:
            result = client.post("/v1/sql", body)
    except LedgerError as exc:
        exit_for(exc)
    if format == "json":
        typer.echo(json.dumps(result, ensure_ascii=False))
    elif format == "csv":
        typer.echo(to_csv(result["columns"], result["rows"]), nl=False)
    else:
        typer.echo(to_table(result["columns"], result["types"], result["rows"]))
        n = len(result["rows"])
        typer.echo(f"({n} row{'s' if n != 1 else ''}, {result['elapsed_s'] * 1000:.1f} ms)")
    if result.get("truncated"):
        if result.get("truncated_by") == "bytes":
            why = "the ledger's answer size cap (CHUNKLEDGER_SQL_MAX_BYTES); select fewer or shorter columns"
        else:
            why = "raise --max-rows or narrow the query"
        typer.echo(f"truncated at {len(result['rows'])} rows: {why}", err=True)


def sql_reader_command(
    db: Annotated[
        str | None,
        typer.Option("--db", help="the ledger's PostgreSQL URL, as its owner (env CHUNKLEDGER_DB_URL)"),
    ] = None,
    role: Annotated[str, typer.Option("--role", help="name of the read-only role")] = "chunkledger_reader",
    password: Annotated[
        str | None, typer.Option("--password", envvar="CHUNKLEDGER_SQL_READER_PASSWORD", help="its password")
    ] = None,
) -> None:
    """PostgreSQL: create or update the role /v1/sql runs as (SELECT on the ledger tables, nothing else)."""
    import os

    import sqlalchemy as sa

    from ledger.sql.guard import first_line
    from ledger.sql.roles import grant_reader_role, reader_url

    url = db or os.environ.get("CHUNKLEDGER_DB_URL", "")
    if not url.startswith("postgresql"):
        typer.echo("error: --db must be the ledger's postgresql URL (DuckDB needs no reader role)", err=True)
        raise typer.Exit(2)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        grant_reader_role(engine, role, password)
    except (ValueError, sa.exc.SQLAlchemyError) as exc:
        typer.echo(f"error: {first_line(getattr(exc, 'orig', None) or exc)}", err=True)
        raise typer.Exit(1) from None
    finally:
        engine.dispose()
    shown = reader_url(url, role, "***" if password else None)
    typer.echo(f"role {role} may now SELECT the ledger tables; set CHUNKLEDGER_SQL_READER_URL={shown}")
