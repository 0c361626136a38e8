"""``chunkledger dashboard --ledger URL [--port 8501]``: run the Streamlit app against a ledger."""

from __future__ import annotations

import os
import site
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from ledger.defaults import DEFAULT_LEDGER_URL

# The folder holding the parts (site-packages in an install, the checkout's root otherwise). The
# dashboard is found there by path, never by `import dashboard`: a package of that name in the folder
# the command runs from (a user's own) must not be the one that runs, or break the command line.
PARTS_DIR = Path(__file__).resolve().parents[1]
APP = PARTS_DIR / "dashboard" / "app.py"


def streamlit_command(port: int, host: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.port",
        str(port),
        "--server.address",
        host,
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        # no Deploy button or developer menu for the operators (dashboard/app.py sets it too)
        "--client.toolbarMode",
        "viewer",
    ]


def streamlit_env(base: Mapping[str, str]) -> dict[str, str]:
    """The Streamlit process's environment: ``base`` without the working directory on the module path
    (``PYTHONSAFEPATH``; ``python -m`` would put it first), so that app.py's ``import dashboard`` is
    this dashboard, not a package of that name where the command was started; from a checkout, its
    root first on the path instead (an install has the parts in site-packages already)."""
    env = {**base, "PYTHONSAFEPATH": "1"}
    if str(PARTS_DIR) not in {*site.getsitepackages(), site.getusersitepackages()}:
        env["PYTHONPATH"] = os.pathsep.join([str(PARTS_DIR), *filter(None, [base.get("PYTHONPATH")])])
    return env


def dashboard(
    ledger: Annotated[
        str,
        typer.Option(help="ledger base URL (env CHUNKLEDGER_LEDGER_URL)", envvar="CHUNKLEDGER_LEDGER_URL"),
    ] = DEFAULT_LEDGER_URL,
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to serve the dashboard on")] = 8501,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    read_token: Annotated[
        str | None,
        typer.Option(
            help="the ledger's read token (env CHUNKLEDGER_READ_TOKEN)", envvar="CHUNKLEDGER_READ_TOKEN"
        ),
    ] = None,
    refresh_s: Annotated[float, typer.Option(min=0, help="auto-refresh period in seconds; 0 = off")] = 10.0,
) -> None:
    """Serve the Streamlit dashboard, reading the ledger through its HTTP API (read token)."""
    try:
        import streamlit  # noqa: F401
    except ImportError:
        typer.echo(
            "error: the dashboard needs its extra: pip install 'chunkledger[dashboard]' "
            "(from a checkout: pip install -e '.[dashboard]')",
            err=True,
        )
        raise typer.Exit(2) from None
    if not ledger.startswith(("http://", "https://")):
        typer.echo(f"error: --ledger: {ledger!r} is not an http(s) URL", err=True)
        raise typer.Exit(2)
    env = {
        **streamlit_env(os.environ),
        "CHUNKLEDGER_LEDGER_URL": ledger.rstrip("/"),
        "CHUNKLEDGER_DASHBOARD_REFRESH_S": str(refresh_s),
    }
    if read_token is not None:
        env["CHUNKLEDGER_READ_TOKEN"] = read_token
    typer.echo(f"dashboard: http://{host}:{port}  (ledger {ledger})", err=True)
    try:
        code = subprocess.call(streamlit_command(port, host), env=env)
    except KeyboardInterrupt:
        code = 0
    raise typer.Exit(code)
