"""Fixtures for the exporter tests: an in-thread fake ledger and an exporter factory with fast timings.

The outage tests in test_delivery_real_ledger.py use the real ledger (``ledger_server`` from
tests/conftest.py) instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_hooks.config import ExporterConfig
from engine_hooks.exporter import Exporter
from tests.support.fake_ledger import FakeLedger

FAST = {
    "spool_fsync": False,
    "flush_interval_s": 0.01,
    "backoff_initial_s": 0.01,
    "backoff_max_s": 0.05,
    "max_attempts": 2,
    "timeout_s": 2.0,
    "connect_timeout_s": 0.5,
}


@pytest.fixture
def fake_ledger() -> Iterator[FakeLedger]:
    ledger = FakeLedger()
    yield ledger
    ledger.stop()


@pytest.fixture
def spool_dir(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def make_exporter(fake_ledger: FakeLedger, spool_dir: Path) -> Iterator[Callable[..., Exporter]]:
    """``make_exporter(**settings)``: an exporter on the fake ledger, shut down after the test."""
    created: list[Exporter] = []

    def make(on_command: Any = None, registry: Any = None, **settings: Any) -> Exporter:
        config = ExporterConfig.create(
            **{
                "url": fake_ledger.url,
                "source_id": "engine-0",
                "spool_dir": str(spool_dir),
                **FAST,
                **settings,
            }
        )
        exporter = Exporter(config, on_command=on_command, registry=registry)
        created.append(exporter)
        return exporter

    yield make
    for exporter in created:
        exporter.shutdown(2.0)
