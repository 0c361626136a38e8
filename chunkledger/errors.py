"""How the command line reports a :class:`ledger.client.LedgerError`: one line on stderr, no traceback."""

from __future__ import annotations

from typing import NoReturn

import typer

from ledger.client import LedgerError


def exit_for(exc: LedgerError, *, token_env: str = "CHUNKLEDGER_READ_TOKEN") -> NoReturn:
    """Exit 2 when the ledger could not be reached, 1 when it answered with an error."""
    if exc.unreachable:
        typer.echo(f"error: {exc}; is `chunkledger serve` running?", err=True)
        raise typer.Exit(2)
    hint = f" (pass --token or set {token_env})" if exc.status_code in (401, 403) else ""
    typer.echo(f"error ({exc.label}): {exc.detail}{hint}", err=True)
    raise typer.Exit(1)
