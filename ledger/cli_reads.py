"""Commands that compute an answer from the ledger's data (``advise``, ``whatif``): asked of a running
ledger over its API, or computed here from a database opened read-only (``--db``).

Both paths give ``(status, body)``: 200 and the answer, or the HTTP status and the error body the API
would have given (``{reason, detail, ...}``), so the command renders one or the other the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer


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


def via_db(
    url: str, compute: Callable[[Any], dict[str, Any]], errors: type[Exception]
) -> tuple[int, dict[str, Any]]:
    """``compute(engine)`` over the database at ``url`` opened read-only. ``errors`` (with ``reason``,
    ``status`` and ``details``) become the error body; exit 2 when the database cannot be read."""
    import sqlalchemy as sa

    # Read-only: never migrate or write someone's ledger from a reporting tool.
    connect_args = {"read_only": True} if url.startswith("duckdb") else {}
    engine = sa.create_engine(url, connect_args=connect_args)
    try:
        return 200, compute(engine)
    except errors as exc:
        details = getattr(exc, "details", {})
        return getattr(exc, "status", 422), {
            "detail": str(exc),
            "reason": getattr(exc, "reason", ""),
            **details,
        }
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
