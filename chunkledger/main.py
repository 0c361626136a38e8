"""The ``chunkledger`` command line."""

from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from ledger.config import Settings

from ledger.defaults import DEFAULT_DB_URL, DEFAULT_PORT

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="chunkledger: the request ledger for LLM serving"
)

DbOpt = Annotated[
    str | None, typer.Option("--db", help=f"database URL (env CHUNKLEDGER_DB_URL; {DEFAULT_DB_URL})")
]


def _settings(**overrides: Any) -> Settings:
    from ledger.config import Settings  # pydantic-settings: loaded only when a command runs

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except Exception as exc:  # pydantic ValidationError: print it readably, no traceback
        typer.echo(f"configuration error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def serve(
    db: DbOpt = None,
    host: Annotated[str | None, typer.Option(help="bind address (env CHUNKLEDGER_HOST)")] = None,
    port: Annotated[
        int | None, typer.Option(help=f"port (env CHUNKLEDGER_PORT, default {DEFAULT_PORT})")
    ] = None,
    access_log: Annotated[bool, typer.Option(help="log every HTTP request")] = False,
) -> None:
    """Upgrade the database schema, then serve the ledger API."""
    import uvicorn

    from engine_hooks.http_timeouts import header_timeout_protocol
    from ledger.app import create_app
    from ledger.config import UnsafeConfig
    from ledger.store import MissingDriver, check_driver

    settings = _settings(db_url=db, host=host, port=port)
    try:
        settings.check_safe_to_bind()
        check_driver(settings.db_url)
    except (UnsafeConfig, MissingDriver) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if settings.policy_file:
        from ledger.rules.policy import PolicyError, load_policy_file

        try:
            load_policy_file(settings.policy_file)
        except PolicyError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ledger_app = create_app(settings, tune_gc=settings.gc_tuning)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            # SIGTERM/SIGINT: the sources' command long-polls (up to 60 s each) answer now, so the
            # graceful shutdown does not wait out its timeout for them.
            # (From a thread: the handler may run while this thread holds the book's lock.)
            service = getattr(ledger_app.state, "runaway", None)
            if service is not None:
                threading.Thread(target=service.book.release_waiters, daemon=True).start()
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    config = uvicorn.Config(
        ledger_app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=access_log,
        timeout_graceful_shutdown=10,
        http=header_timeout_protocol(settings.header_timeout_s),
    )
    Server(config).run()


@app.command()
def migrate(db: DbOpt = None) -> None:
    """Create or upgrade the ledger tables (Alembic) and print the revision."""
    from ledger import migrate as m
    from ledger.store import MissingDriver, make_engine

    settings = _settings(db_url=db)
    try:
        engine = make_engine(settings.db_url)
    except MissingDriver as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    m.upgrade(engine)
    typer.echo(
        json.dumps(
            {"db": engine.url.render_as_string(hide_password=True), "revision": m.current_revision(engine)}
        )
    )
    engine.dispose()


def _register_optional_commands() -> None:
    try:
        from chunkledger.simulator import simulate
    except ImportError:  # the simulator has optional parts; the rest of the CLI works without it
        return
    app.command(name="simulate")(simulate)


_register_optional_commands()


def _register_gateway() -> None:
    from chunkledger.gateway import gateway

    app.command(name="gateway")(gateway)


_register_gateway()


def _register_advice() -> None:
    from chunkledger.advice import advise, profile

    app.command(name="advise")(advise)
    app.command(name="profile")(profile)


_register_advice()


def _register_whatif() -> None:
    from chunkledger.whatif import whatif

    app.command(name="whatif")(whatif)


_register_whatif()


def _register_analytics() -> None:
    from chunkledger.analytics import register

    register(app)


_register_analytics()


def _register_rules() -> None:
    from chunkledger.rules import register

    register(app)


_register_rules()


def _register_sql() -> None:
    from chunkledger.export import export_command
    from chunkledger.sql import query_command, sql_reader_command

    app.command(name="query")(query_command)
    app.command(name="export")(export_command)
    app.command(name="sql-reader")(sql_reader_command)


_register_sql()


def _register_dashboard() -> None:
    from chunkledger.dashboard import dashboard  # imports streamlit only when the command runs

    app.command(name="dashboard")(dashboard)


_register_dashboard()


def main() -> None:
    app(prog_name="chunkledger")


if __name__ == "__main__":
    main()
