"""Running the gateway under uvicorn (the CLI) and in a thread (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import uvicorn

from engine_hooks.gateway.app import Gateway
from engine_hooks.http_timeouts import header_timeout_protocol


def uvicorn_config(gateway: Gateway, host: str, port: int, log_level: str = "warning") -> uvicorn.Config:
    """uvicorn settings for a proxy: no Server/Date headers of its own (the upstream's pass through),
    no access log, no X-Forwarded-* rewriting of the client address (the gateway does not use it),
    httptools and uvloop when installed, and a header timeout (``header_timeout_s``)."""
    return uvicorn.Config(
        gateway,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        server_header=False,
        date_header=False,
        proxy_headers=False,
        lifespan="on",
        loop="auto",
        http=header_timeout_protocol(gateway.config.header_timeout_s),
        timeout_graceful_shutdown=5,
    )


class ServerThread:
    """A uvicorn server on its own event loop in a daemon thread; ``start()`` waits until it listens."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **config: Any):
        if isinstance(app, Gateway):
            cfg = uvicorn_config(app, host, port)
        else:
            cfg = uvicorn.Config(
                app, host=host, port=port, log_level="warning", access_log=False, lifespan="on"
            )
        for key, value in config.items():
            setattr(cfg, key, value)
        self.server = uvicorn.Server(cfg)
        self.app = app
        self.host = host
        self.port = port
        self._thread = threading.Thread(target=self._run, name="chunkledger-server", daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self.server.serve())

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.005)
        sockets = [s for server in self.server.servers for s in server.sockets]
        self.port = sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
