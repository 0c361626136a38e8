"""``chunkledger simulate``: the fleet simulator (:mod:`engine_hooks.simulator`) from the command line."""

from __future__ import annotations

import json
import logging
from typing import Annotated

import typer

from engine_hooks.config import ConfigError
from engine_hooks.simulator import SCENARIOS, run_simulation


def simulate(
    engines: Annotated[int, typer.Option(min=1, help="simulated engines")] = 4,
    rps: Annotated[float, typer.Option(min=0.001, help="requests per second for the fleet")] = 20.0,
    duration: Annotated[
        float, typer.Option(min=0.001, help="seconds to simulate (paced to the wall clock)")
    ] = 30.0,
    ledger: Annotated[
        str | None, typer.Option(help="ledger base URL (env CHUNKLEDGER_URL)", envvar="CHUNKLEDGER_URL")
    ] = None,
    scenario: Annotated[str, typer.Option(help=f"one of: {', '.join(SCENARIOS)}")] = "steady",
    seed: Annotated[int, typer.Option(help="random seed; same seed, same events")] = 0,
    spool_dir: Annotated[
        str | None,
        typer.Option(
            help="spool folder of the simulated sources, one subfolder per source id (default: "
            "CHUNKLEDGER_SPOOL_DIR, else .chunkledger/spool): what a run could not deliver is sent by "
            "the next run with the same source ids"
        ),
    ] = None,
    drain_timeout: Annotated[
        float,
        typer.Option(
            min=0, help="after the run, wait up to this many seconds for the ledger to take every event"
        ),
    ] = 120.0,
    ingest_token: Annotated[
        str | None,
        typer.Option(help="ingest token (env CHUNKLEDGER_INGEST_TOKEN)", envvar="CHUNKLEDGER_INGEST_TOKEN"),
    ] = None,
    source_prefix: Annotated[
        str,
        typer.Option(
            help="source ids <prefix>-engine-<i> and <prefix>-gateway-0, request ids "
            "<prefix>-<seed>-req-<n>; use a new prefix (or seed) per run on the same ledger so that the "
            "requests of two runs do not merge"
        ),
    ] = "sim",
) -> None:
    """Emit realistic event streams for N engines and a gateway through the real exporter.

    Prints one JSON line at the end: events emitted and last seq per source, and exporter counters.
    """
    if not ledger:
        typer.echo("error: --ledger (or CHUNKLEDGER_URL) is required", err=True)
        raise typer.Exit(2)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        summary = run_simulation(
            engines=engines,
            rps=rps,
            duration_s=duration,
            ledger_url=ledger,
            scenario=scenario,
            seed=seed,
            spool_dir=spool_dir,
            ingest_token=ingest_token,
            source_prefix=source_prefix,
            drain_timeout_s=drain_timeout,
        )
    except (ValueError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(json.dumps(summary, sort_keys=False))
    drain = summary["drain"]
    if not drain["drained"]:
        waiting = sum(drain["spool_pending"].values())
        typer.echo(
            f"warning: the ledger had not taken every event {drain_timeout:g} s after the run; "
            f"{waiting} events stay spooled in {drain['spool_dir']} for the next run with source prefix "
            f"{source_prefix!r}",
            err=True,
        )
