"""Fixtures for the gateway tests: a fake upstream (a real HTTP server in a thread), the fake ledger,
and a factory for gateways served in a thread of their own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_hooks.config import ExporterConfig
from engine_hooks.gateway.app import Gateway
from engine_hooks.gateway.config import GatewayConfig
from engine_hooks.gateway.server import ServerThread
from tests.support.fake_ledger import wait_until
from tests.support.fake_upstream import FakeUpstream

FAST_EXPORTER = {
    "spool_fsync": False,
    "flush_interval_s": 0.01,
    "backoff_initial_s": 0.01,
    "backoff_max_s": 0.05,
    "max_attempts": 2,
    "timeout_s": 2.0,
    "connect_timeout_s": 0.5,
}


class Upstream:
    def __init__(self) -> None:
        self.app = FakeUpstream()
        self.server = ServerThread(self.app).start()
        self.url = self.server.url


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.server.stop()


class RunningGateway:
    def __init__(self, gateway: Gateway, server: ServerThread):
        self.gateway = gateway
        self.server = server
        self.url = server.url

    def flush(self) -> None:
        """Wait until no request is in the gateway (its last events are emitted), then deliver them."""
        assert wait_until(lambda: not self.gateway._active), "requests still in the gateway"
        assert self.gateway.exporter is not None
        assert self.gateway.exporter.force_flush(5.0), "gateway events not delivered"


@pytest.fixture
def make_gateway(tmp_path: Path) -> Iterator[Callable[..., RunningGateway]]:
    """``make_gateway(upstream_url, ledger_url=None, **settings)``: a gateway serving on a free port."""
    running: list[RunningGateway] = []

    def make(upstream_url: str, ledger_url: str | None = None, **settings: Any) -> RunningGateway:
        exporter = None
        if ledger_url is not None:
            exporter = ExporterConfig.create(
                url=ledger_url,
                source_id="gw-test",
                source_kind="gateway",
                spool_dir=str(tmp_path / "spool"),
                **FAST_EXPORTER,
            )
        gateway = Gateway(GatewayConfig.create(upstream=upstream_url, **settings), exporter_config=exporter)
        server = ServerThread(gateway).start()
        rg = RunningGateway(gateway, server)
        running.append(rg)
        return rg

    yield make
    for rg in running:
        rg.server.stop()
