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
