"""``chunkledger gateway``: run the proxy in front of an OpenAI-compatible server."""

from __future__ import annotations

import logging
import os
import socket
from typing import Annotated

import typer

from engine_hooks.config import ConfigError, ExporterConfig, ExporterSettings
from engine_hooks.gateway.config import GatewayConfig, GatewayConfigError


def gateway(
    upstream: Annotated[
        str, typer.Option(help="base URL of the OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    ],
    port: Annotated[int, typer.Option(help="port to listen on")] = 8080,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    max_in_flight: Annotated[int, typer.Option(help="requests forwarded upstream at once")] = 64,
    max_queue: Annotated[int, typer.Option(help="requests allowed to wait; one more gets 429")] = 1024,
    max_queue_wait_s: Annotated[float, typer.Option(help="longest wait for a slot, then 503")] = 30.0,
    retry_after_s: Annotated[float, typer.Option(help="Retry-After sent with 429 and 503")] = 1.0,
    connect_timeout_s: Annotated[float, typer.Option(help="TCP connect timeout to the upstream")] = 5.0,
    read_timeout_s: Annotated[
        float, typer.Option(help="longest upstream silence (before headers, between stream chunks)")
    ] = 300.0,
    header_timeout_s: Annotated[
        float, typer.Option(help="close a client connection without a whole request head this long")
    ] = 10.0,
    body_timeout_s: Annotated[
        float, typer.Option(help="a request body not complete this long after its head gets 408")
    ] = 30.0,
    ledger: Annotated[
        str | None, typer.Option(help="ledger URL for events and cutoff commands (env CHUNKLEDGER_URL)")
    ] = None,
    source_id: Annotated[
        str | None,
        typer.Option(help="this gateway's source id (env CHUNKLEDGER_SOURCE_ID; default gw-<host>-<port>)"),
    ] = None,
    poll_commands: Annotated[bool, typer.Option(help="long-poll the ledger for cutoff commands")] = True,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error")] = "info",
) -> None:
    """Proxy /v1/completions, /v1/chat/completions and /v1/models to UPSTREAM with an admission queue,
    sending entry and admission events to the ledger and cutting streams on its cutoff commands."""
    import uvicorn

    from engine_hooks.gateway.app import Gateway
    from engine_hooks.gateway.server import uvicorn_config

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = GatewayConfig.create(
            upstream=upstream,
            max_in_flight=max_in_flight,
            max_queue=max_queue,
            max_queue_wait_s=max_queue_wait_s,
            retry_after_s=retry_after_s,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            header_timeout_s=header_timeout_s,
            body_timeout_s=body_timeout_s,
            poll_commands=poll_commands,
        )
    except GatewayConfigError as exc:
        typer.echo(f"configuration error: {exc}", err=True)
        raise typer.Exit(2) from None
    exporter_config = None
    if ledger or os.environ.get("CHUNKLEDGER_URL"):
        overrides: ExporterSettings = {"source_kind": "gateway"}
        if ledger:
            overrides["url"] = ledger
        if source_id or not os.environ.get("CHUNKLEDGER_SOURCE_ID"):
            overrides["source_id"] = source_id or f"gw-{socket.gethostname()[:100]}-{port}"
        try:
            exporter_config = ExporterConfig.from_env(**overrides)
        except ConfigError as exc:
            typer.echo(f"configuration error: {exc}", err=True)
            raise typer.Exit(2) from None
    else:
        logging.getLogger(__name__).warning(
            "no ledger configured (--ledger or CHUNKLEDGER_URL): proxying without events or cutoff commands"
        )
    app = Gateway(config, exporter_config=exporter_config)
    uvicorn.Server(uvicorn_config(app, host, port, log_level.lower())).run()
