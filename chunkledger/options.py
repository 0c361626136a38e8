"""The options every client command of the ledger's API shares: where the ledger is and the read token.

Imports nothing heavy, so the command line's help stays quick.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ledger.defaults import DEFAULT_LEDGER_URL, LEDGER_URL_ENV

LedgerUrlOpt = Annotated[
    str,
    typer.Option(
        "--ledger",
        envvar=list(LEDGER_URL_ENV),
        help=f"the running ledger's base URL (env CHUNKLEDGER_LEDGER_URL; {DEFAULT_LEDGER_URL})",
    ),
]
ReadTokenOpt = Annotated[
    str | None, typer.Option("--token", envvar="CHUNKLEDGER_READ_TOKEN", help="read token (env ...)")
]

# -- the commands that compute an answer from the ledger's data (advise, whatif: chunkledger.reads) -------
LedgerOrNoneOpt = Annotated[
    str | None,
    typer.Option(
        "--ledger",
        envvar=list(LEDGER_URL_ENV),
        help=f"ledger base URL (env CHUNKLEDGER_LEDGER_URL; default {DEFAULT_LEDGER_URL})",
    ),
]
DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db", help="read a database directly instead (PostgreSQL, or a DuckDB file no ledger serves)"
    ),
]
ModelOpt = Annotated[
    str | None, typer.Option("--model", help="served model (when engines of several models report)")
]
SourceOpt = Annotated[str | None, typer.Option("--source", help="one engine source id")]
SinceOpt = Annotated[
    str | None, typer.Option("--since", help="window start: unix seconds, ISO 8601, or an age (2h)")
]
UntilOpt = Annotated[str | None, typer.Option("--until", help="window end (same forms)")]
FormatOpt = Annotated[str, typer.Option("--format", help="table or json")]
