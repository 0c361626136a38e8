"""``chunkledger export``: a window of the ledger as Parquet files, through the service or from the
database. The export itself is ``ledger.export``; this module holds the command, so that the command
line's help does not load pyarrow."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from chunkledger.options import LedgerUrlOpt, ReadTokenOpt
from ledger.defaults import DEFAULT_LEDGER_URL

if TYPE_CHECKING:
    from ledger.export import Manifest
    from ledger.export import Window as ExportWindow


def export_command(
    since: Annotated[
        str, typer.Option("--since", help="window start: ISO 8601, unix seconds, or an age (1h, 2d)")
    ],
    out: Annotated[Path, typer.Option("--out", help="directory for <table>.parquet and manifest.json")],
    until: Annotated[str | None, typer.Option("--until", help="window end (default: open)")] = None,
    format: Annotated[Literal["parquet"], typer.Option("--format", help="file format")] = "parquet",
    db: Annotated[
        str | None,
        typer.Option("--db", help="read the database directly (the service must not hold a DuckDB file)"),
    ] = None,
    ledger: LedgerUrlOpt = DEFAULT_LEDGER_URL,
    token: ReadTokenOpt = None,
    tables: Annotated[
        str | None, typer.Option("--tables", help="comma-separated subset (default: every table)")
    ] = None,
) -> None:
    """Write a window of the ledger (requests view, steps, events, sources) as Parquet files.

    Through the running ledger by default; with --db, straight from the database.
    """
    from ledger.export import (
        TABLES,
        LedgerLocked,
        Window,
        direct_connection,
        export_dir,
        parse_time,
        write_manifest,
    )

    try:
        window = Window(
            since=parse_time(since, field="--since"),
            until=None if until is None else parse_time(until, field="--until"),
        )
        names = TABLES if tables is None else tuple(t.strip() for t in tables.split(",") if t.strip())
        bad = [t for t in names if t not in TABLES]
        if bad or not names:
            raise ValueError(f"--tables: {', '.join(bad) or 'none'}; choose from {', '.join(TABLES)}")
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    assert format == "parquet"
    out.mkdir(parents=True, exist_ok=True)
    if db:
        try:
            with direct_connection(db) as (conn, dialect):
                manifest = export_dir(conn, dialect, window, out, names)
        except (LedgerLocked, FileNotFoundError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        import sqlalchemy as sa

        manifest.source = sa.engine.make_url(db).render_as_string(hide_password=True)
        write_manifest(out, manifest)
    else:
        manifest = _export_through(ledger, token, window, out, names)
        write_manifest(out, manifest)
    for table, info in manifest.tables.items():
        typer.echo(f"{table:<9} {info.rows:>10} rows {info.bytes / 1024:>10.1f} KiB  {out / info.file}")


def _export_through(
    ledger: str, token: str | None, window: ExportWindow, out: Path, names: tuple[str, ...]
) -> Manifest:
    import pyarrow.parquet as pq

    from chunkledger.errors import exit_for
    from ledger.client import LedgerClient, LedgerError
    from ledger.export import ExportedTable, Manifest

    manifest = Manifest(window=window.record(), exported_at=time.time(), source=ledger)
    with LedgerClient(ledger, token, timeout_s=3600.0) as client:
        for table in names:
            path = out / f"{table}.parquet"
            tmp = path.with_name(path.name + ".part")
            try:
                with (
                    client.stream(f"/v1/export/{table}.parquet", since=window.since, until=window.until) as r,
                    open(tmp, "wb") as f,
                ):
                    for chunk in r.iter_bytes():
                        f.write(chunk)
                os.replace(tmp, path)
            except LedgerError as exc:
                exit_for(exc)
            finally:
                tmp.unlink(missing_ok=True)
            rows = pq.read_metadata(path).num_rows
            manifest.tables[table] = ExportedTable.of(path, rows)
    return manifest
