"""vLLM's own scheduler tests, run with chunkledger's scheduler classes in place of vLLM's: the referee.

``scripts/vllm_referee.sh VERSION`` runs a release's ``tests/v1/core`` scheduler tests (from its sdist,
``.cache/vllm/VERSION``) with ``-p referee_plugin``. vLLM's tests build their scheduler through names
they import (``Scheduler``, ``AsyncScheduler``); after collection this plugin rebinds those names in
every ``tests.*`` module to ``LedgerScheduler`` and ``AsyncLedgerScheduler``, so each test asserts
vLLM's exact scheduling decisions of a scheduler that carries the hooks. The hooks are on: each
scheduler reports to the ledger at ``CHUNKLEDGER_URL`` (a real one, started by the script) under its
own source id, and after each test its exporter is flushed and shut down. A test fails when the
hooks raised inside it (``hook_errors``; the plugin catches them so vLLM never sees them), and the
session fails when no scheduler was swapped in or the ledger acknowledged nothing.

``REFEREE_CLASSES=vllm`` runs vLLM's classes untouched (the baseline: which tests pass on this host at
all). Offline: the hub checkpoints the tests name resolve to config-only stand-ins
(:mod:`hub_standins`).
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hub_standins import write_hub_cache

_HF = Path(os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="referee-hf-")))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
write_hub_cache(_HF / "hub")

import vllm.platforms as platforms  # noqa: E402
from vllm.platforms.interface import UnspecifiedPlatform  # noqa: E402


class HostPlatform(UnspecifiedPlatform):
    """The platform the scheduler tests get: a device type and nothing else. vLLM's CPU platform
    would check the host's kernels (0.34's wants triton-cpu on x86), which no scheduler test uses,
    and with no platform at all vLLM cannot name the device."""

    device_type = "cpu"
    device_name = "cpu"


platforms._current_platform = HostPlatform()

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from engine_hooks.vllm import scheduler as plugin  # noqa: E402

CLASSES = os.environ.get("REFEREE_CLASSES", "ledger")
if CLASSES not in ("ledger", "vllm"):
    raise ValueError(f"REFEREE_CLASSES={CLASSES!r}: expected ledger or vllm")
SWAP = {Scheduler: plugin.LedgerScheduler, AsyncScheduler: plugin.AsyncLedgerScheduler}


class _Referee:
    """The schedulers built during the current test, and the session's totals."""

    def __init__(self) -> None:
        self.numbers = itertools.count()
        self.current: list[Any] = []
        self.swapped = 0  # names rebound in vLLM's test modules
        self.schedulers = 0
        self.reporting = 0  # of those, with an exporter (the hooks on)
        self.acknowledged = 0  # events the ledger acknowledged
        self.failed_posts = 0
        self.hook_errors = 0
        self.deselected = 0  # tests in the baseline (failing with vLLM's classes too)
        self.failed: list[str] = []  # node ids that failed, for RECORD


REFEREE = _Referee()
_init = plugin._LedgerHooks.__init__


def _tracked_init(self: Any, *args: Any, **kwargs: Any) -> None:
    """Each scheduler its own source (vLLM's tests reuse request ids from one test to the next)."""
    os.environ["CHUNKLEDGER_SOURCE_ID"] = f"referee-{os.getpid()}-{next(REFEREE.numbers)}"
    _init(self, *args, **kwargs)
    REFEREE.current.append(self)


plugin._LedgerHooks.__init__ = _tracked_init  # type: ignore[method-assign]


KNOWN = os.environ.get("REFEREE_KNOWN")  # a baseline: tests that fail here with vLLM's classes too
RECORD = os.environ.get("REFEREE_RECORD")  # with vLLM's classes: write that baseline here


def _known() -> set[str]:
    if not KNOWN:
        return set()
    lines = Path(KNOWN).read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    known = _known()
    if known:
        kept = [item for item in items if item.nodeid not in known]
        dropped = [item for item in items if item.nodeid in known]
        items[:] = kept
        config.hook.pytest_deselected(items=dropped)
        REFEREE.deselected = len(dropped)
    if CLASSES != "ledger":
        return
    for name, module in list(sys.modules.items()):
        if not name.startswith("tests.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value in SWAP:
                setattr(module, attr, SWAP[value])
                REFEREE.swapped += 1


@pytest.fixture(autouse=True)
def _referee_each_test() -> Any:
    REFEREE.current = []
    yield
    errors = 0
    for sch in REFEREE.current:
        REFEREE.schedulers += 1
        errors += sch.hook_errors
        exporter = sch._cl_exporter
        if exporter is None:
            continue
        REFEREE.reporting += 1
        exporter.shutdown(10.0)
        stats = exporter.stats()
        REFEREE.acknowledged += stats.sent
        REFEREE.failed_posts += stats.send_failures
    REFEREE.current = []
    REFEREE.hook_errors += errors
    assert errors == 0, f"chunkledger's hooks raised {errors} time(s) in this test (see the log)"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        REFEREE.failed.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    r = REFEREE
    if RECORD and CLASSES == "vllm":
        import vllm

        header = (
            f"# vLLM {vllm.__version__}'s scheduler tests that fail on this host with vLLM's own classes\n"
            "# (written by REFEREE_CLASSES=vllm scripts/vllm_referee.sh VERSION --record; deselected in\n"
            "# the referee's runs with chunkledger's classes)\n"
        )
        Path(RECORD).write_text(header + "".join(f"{n}\n" for n in sorted(set(r.failed))))
    print(
        f"\nreferee ({CLASSES} classes): {r.deselected} deselected (baseline), "
        f"{r.swapped} names swapped, {r.schedulers} schedulers, "
        f"{r.reporting} reporting, {r.acknowledged} events acknowledged by the ledger, "
        f"{r.failed_posts} failed posts, {r.hook_errors} hook errors"
    )
    if CLASSES == "ledger" and (r.swapped == 0 or r.reporting == 0 or r.acknowledged == 0):
        print("referee: the hooks never ran against a ledger: failing the session")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's conftest fixture of that name (its root conftest is not loaded here)."""
    import logging

    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate: None, caplog: pytest.LogCaptureFixture) -> Any:
    """vLLM's conftest fixture of that name."""
    import logging

    with caplog.at_level(logging.INFO):
        yield caplog
