"""Fixtures for the dashboard tests: a real ledger filled by a recorded simulator run, one filled by
replaying a run recorded from real vLLM (``tests/dashboard/data/vllm_run.jsonl.gz``, made by
``tools/record_vllm_run.py``), an empty one, and AppTest runs of the dashboard's pages against them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("streamlit", reason="the dashboard extra is not installed: pip install -e '.[dashboard]'")

from streamlit.testing.v1 import AppTest

from dashboard import data
from engine_hooks.simulator import run_simulation
from ledger.client import LedgerClient
from tests.dashboard import replay
from tests.support import ROOT
from tests.support.servers import LedgerServer

APP = str(ROOT / "dashboard" / "app.py")
PAGES = {
    "overview": "views/overview.py",
    "requests": "views/requests.py",
    "request": "views/request.py",
    "kv": "views/kv.py",
    "cutoffs": "views/cutoffs.py",
    "advice": "views/advice.py",
    "whatif": "views/whatif.py",
    "sql": "views/sql.py",
}


@pytest.fixture(scope="session")
def recorded_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LedgerServer]:
    """A ledger holding one recorded run: 2 simulated engines and a gateway, the long-prompt scene
    (20k-token prompts among short ones, runaways that the loop rule cuts), 40 s of virtual time run
    as fast as the machine goes (about 340 requests, 26k events); plus one engine under KV pressure
    (preemptions) for 30 s."""
    tmp = tmp_path_factory.mktemp("recorded")
    server = LedgerServer(f"duckdb:///{tmp / 'ledger.duckdb'}", tmp / "ledger.log")
    server.start()
    summary = run_simulation(
        engines=2,
        rps=8,
        duration_s=40,
        ledger_url=server.url,
        scenario="long-prompts",
        seed=3,
        pace=False,
        source_prefix="rec",
        spool_dir=str(tmp / "spool"),
    )
    assert summary["requests"] > 200 and not summary["exporter"]["dropped"]
    # One engine short of KV cache beside them: preemptions and resumes.
    summary = run_simulation(
        engines=1,
        rps=10,
        duration_s=30,
        ledger_url=server.url,
        scenario="kv-pressure",
        seed=4,
        pace=False,
        source_prefix="kvp",
        spool_dir=str(tmp / "spool"),
    )
    assert not summary["exporter"]["dropped"]
    yield server
    server.stop()


# The recorded vLLM run ends this long before the replay: inside the dashboard's default window (1 hour),
# far enough back that the time buckets are wide (120 s) and the whole run falls in one or two of them,
# as an operator sees a run from earlier in the hour.
VLLM_RUN_AGE_S = 45 * 60


@pytest.fixture(scope="session")
def vllm_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LedgerServer]:
    """A ledger holding a run recorded from real vLLM (the LedgerScheduler plugin and the gateway in
    front; a small KV cache: preemptions; long prompts; a runaway the loop rule cut), replayed through
    ``POST /v1/events`` with its timestamps moved to end ``VLLM_RUN_AGE_S`` ago. No vLLM runs here."""
    tmp = tmp_path_factory.mktemp("vllm_run")
    server = LedgerServer(f"duckdb:///{tmp / 'ledger.duckdb'}", tmp / "ledger.log")
    server.start()
    out = replay.replay(server.url, replay.load(), end_at=time.time() - VLLM_RUN_AGE_S)
    assert out["accepted"] > 1000
    yield server
    server.stop()


@pytest.fixture
def vllm_api(vllm_ledger: LedgerServer) -> Iterator[LedgerClient]:
    with LedgerClient(vllm_ledger.url) as c:
        yield c


@pytest.fixture(scope="session")
def empty_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LedgerServer]:
    tmp = tmp_path_factory.mktemp("empty")
    server = LedgerServer(f"duckdb:///{tmp / 'ledger.duckdb'}", tmp / "ledger.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def api(recorded_ledger: LedgerServer) -> Iterator[LedgerClient]:
    with LedgerClient(recorded_ledger.url) as c:
        yield c


RunPage = Callable[..., AppTest]


@pytest.fixture
def run_page(monkeypatch: pytest.MonkeyPatch) -> RunPage:
    """Run one page of the dashboard app against ``url``; returns the finished AppTest."""

    def run(
        url: str, page: str, query: dict[str, str] | None = None, *, window: str | None = None
    ) -> AppTest:
        monkeypatch.setenv("CHUNKLEDGER_LEDGER_URL", url)
        monkeypatch.setenv("CHUNKLEDGER_DASHBOARD_REFRESH_S", "0")
        data.CACHE.clear()
        at = AppTest.from_file(APP, default_timeout=60)
        for k, v in (query or {}).items():
            at.query_params[k] = v
        if window is not None:
            at.query_params["window"] = window
        at.switch_page(PAGES[page])
        at.run()
        return at

    return run


os.environ.setdefault("STREAMLIT_BROWSER_GATHER_USAGE_STATS", "false")
