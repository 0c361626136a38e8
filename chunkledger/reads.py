"""Commands that compute an answer from the ledger's data (``advise``, ``whatif``): asked of a running
ledger over its API, or computed here from a database opened read-only (``--db``).

Both paths give the answer as the record the ledger builds it as (decoded once, here, from the API's
JSON), or a :class:`Refused`: the HTTP status and the error body the API would have given (``{reason,
detail, ...}``), so the command renders one or the other the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import msgspec
import typer

from ledger.defaults import DEFAULT_LEDGER_URL
from ledger.records import Record, as_json
from ledger.refusal import Refusal

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class Refused:
    """No answer: the HTTP status and the API's error body. The body is open: besides ``reason`` and
    ``detail`` a route adds its own figures (advice's window and partial advice, what-if's calibration)."""

    status: int
    body: Mapping[str, object]


def via_http(url: str, token: str | None, path: str, query: msgspec.Struct, record: type[R]) -> R | Refused:
    """``GET path`` with ``query`` as its parameters on the ledger at ``url``, decoded into ``record``;
    exit 2 when the ledger cannot be reached or answers something else (another version's answer)."""
    from ledger.client import LedgerClient, LedgerError

    try:
        with LedgerClient(url, token, timeout_s=300.0) as client:
            body = client.get(path, **msgspec.to_builtins(query))
    except LedgerError as exc:
        if exc.unreachable:
            typer.echo(f"error: {exc} (start it, or pass --db)", err=True)
            raise typer.Exit(2) from None
        status = exc.status_code or 0
        if not isinstance(exc.body, dict):
            return Refused(status, {"detail": exc.detail[:500], "reason": f"http_{status}"})
        if status in (401, 403):
            hint = "pass --token or CHUNKLEDGER_READ_TOKEN"
            return Refused(status, {"reason": "auth", "detail": f"{exc.detail} ({hint})"})
        return Refused(status, exc.body)
    try:
        return msgspec.convert(body, record)
    except msgspec.ValidationError as exc:
        typer.echo(
            f"error: {url}{path} answered something other than the {record.__name__} record: {exc}", err=True
        )
        raise typer.Exit(2) from None


def via_db(url: str, compute: Callable[[Engine], R]) -> R | Refused:
    """``compute(engine)`` over the database at ``url`` opened read-only; a :class:`Refusal` becomes
    the error body; exit 2 when the database cannot be read."""
    import sqlalchemy as sa

    # Read-only: never migrate or write someone's ledger from a reporting tool.
    connect_args = {"read_only": True} if url.startswith("duckdb") else {}
    engine = sa.create_engine(url, connect_args=connect_args)
    try:
        return compute(engine)
    except Refusal as exc:
        return Refused(exc.status, {"detail": str(exc), "reason": exc.reason, **exc.details})
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
    query: msgspec.Struct,
    record: type[R],
    compute: Callable[[Engine], R],
    render: Callable[[R], str],
    render_refusal: Callable[[Mapping[str, object]], str],
) -> None:
    """Ask ``path`` of the ledger (or ``compute`` it over ``db``), print the answer (``--format json``:
    as the API gives it; else ``render(answer)`` or ``render_refusal(error body)``) and exit 1 when
    there is none."""
    if fmt not in ("table", "json"):
        typer.echo("error: --format must be table or json", err=True)
        raise typer.Exit(2)
    if db and ledger:
        typer.echo("error: pass either --ledger or --db, not both", err=True)
        raise typer.Exit(2)
    got = via_db(db, compute) if db else via_http(ledger or DEFAULT_LEDGER_URL, token, path, query, record)
    if isinstance(got, Refused):
        typer.echo(json.dumps(got.body, indent=2) if fmt == "json" else render_refusal(got.body))
        raise typer.Exit(1)
    typer.echo(json.dumps(as_json(got), indent=2) if fmt == "json" else render(got))
