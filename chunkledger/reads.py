"""Commands that compute an answer from the ledger's data (``advise``, ``whatif``): asked of a running
ledger over its API, or computed here from a database opened read-only (``--db``).

Both paths give ``(status, body)``: 200 and the answer, or the HTTP status and the error body the API
would have given (``{reason, detail, ...}``), so the command renders one or the other the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import typer

from ledger.defaults import DEFAULT_LEDGER_URL
from ledger.refusal import Refusal


def via_http(url: str, token: str | None, path: str, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``GET path`` on the ledger at ``url``; exit 2 when it cannot be reached."""
    from ledger.client import LedgerClient, LedgerError

    try:
        with LedgerClient(url, token, timeout_s=300.0) as client:
            return 200, client.get(path, **params)
    except LedgerError as exc:
        if exc.unreachable:
            typer.echo(f"error: {exc} (start it, or pass --db)", err=True)
            raise typer.Exit(2) from None
        status = exc.status_code or 0
        if not isinstance(exc.body, dict):
            return status, {"detail": exc.detail[:500], "reason": f"http_{status}"}
        if status in (401, 403):
            hint = "pass --token or CHUNKLEDGER_READ_TOKEN"
            return status, {"reason": "auth", "detail": f"{exc.detail} ({hint})"}
        return status, exc.body


def via_db(url: str, compute: Callable[[Any], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """``compute(engine)`` over the database at ``url`` opened read-only; a :class:`Refusal` becomes
    the error body; exit 2 when the database cannot be read."""
    import sqlalchemy as sa

    # Read-only: never migrate or write someone's ledger from a reporting tool.
    connect_args = {"read_only": True} if url.startswith("duckdb") else {}
    engine = sa.create_engine(url, connect_args=connect_args)
    try:
        return 200, compute(engine)
    except Refusal as exc:
        return exc.status, {"detail": str(exc), "reason": exc.reason, **exc.details}
    except sa.exc.SQLAlchemyError as exc:
        orig = getattr(exc, "orig", None)
        msg = str(orig if orig is not None else exc).splitlines()[0]
        hint = (
            " (a running ledger holds the DuckDB file: use --ledger URL)"
            if "lock" in msg.lower()
            else " (is it a ledger database? chunkledger migrate creates one)"
        )
        typer.echo(
            f"error: cannot read {engine.url.render_as_string(hide_password=True)}: {msg}{hint}", err=True
        )
        raise typer.Exit(2) from None
    finally:
        engine.dispose()


def answer(
    *,
    fmt: str,
    db: str | None,
    ledger: str | None,
    token: str | None,
    path: str,
    params: dict[str, Any],
    compute: Callable[[Any], dict[str, Any]],
    render: Callable[[int, dict[str, Any]], str],
) -> None:
    """Ask ``path`` of the ledger (or ``compute`` it over ``db``), print the answer (``--format json``:
    as the API gives it; else ``render(status, body)``) and exit 1 when there is none."""
    if fmt not in ("table", "json"):
        typer.echo("error: --format must be table or json", err=True)
        raise typer.Exit(2)
    if db and ledger:
        typer.echo("error: pass either --ledger or --db, not both", err=True)
        raise typer.Exit(2)
    if db:
        status, body = via_db(db, compute)
    else:
        status, body = via_http(ledger or DEFAULT_LEDGER_URL, token, path, params)
    typer.echo(json.dumps(body, indent=2) if fmt == "json" else render(status, body))
    if status != 200:
        raise typer.Exit(1)
