"""The dashboard in a real browser: ``chunkledger dashboard`` serves it, headless Chromium loads every
page, waits for it to render and takes a screenshot; a Streamlit exception box or a chart with nothing
drawn in it fails the test.

Chromium: Debian's ``chromium`` (scripts/test.sh installs it when missing), or CHUNKLEDGER_CHROMIUM.
Screenshots go to CHUNKLEDGER_SCREENSHOTS (default: the test's temporary folder).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest
from dash_browser import Browser, find_chromium

from tests.conftest import LedgerServer, free_port

pytestmark = pytest.mark.slow

# page -> charts it must draw with the recorded run (at least)
PAGES = {
    "": 7,  # overview: TTFT, e2e, ITL tails; stacked layers, p99 per layer; two throughput charts
    "requests": 0,
    "kv": 3,
    "cutoffs": 1,
    "advice": 2,
    "sql": 0,
}


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed; scripts/test.sh installs it (apt-get install chromium)")
        pytest.skip("chromium not installed (apt-get install chromium)")
    return path


def _serve(args: list[str], url: str, log: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(args, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[:4]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"not serving at {url}: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@pytest.fixture(scope="module")
def dashboard_url(recorded_ledger: LedgerServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("dashboard") / "dashboard.log"
    cmd = [
        sys.executable,
        "-m",
        "ledger.cli",
        "dashboard",
        "--ledger",
        recorded_ledger.url,
        "--port",
        str(port),
    ]
    proc = _serve(cmd, f"{url}/_stcore/health", log)
    yield url
    _stop(proc)


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[Browser]:
    b = Browser(chromium)
    yield b
    b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = os.environ.get("CHUNKLEDGER_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        return Path(out)
    return tmp_path_factory.mktemp("screenshots")


def test_every_page_renders_in_chromium_without_errors_or_empty_charts(
    dashboard_url: str, browser: Browser, shots: Path, api
) -> None:
    longest = api.get("/v1/requests", sort="backend_wait_s", order="desc", limit=1, live=False)["rows"][0]
    pages = {**PAGES, f"request?id={longest['request_id']}": 1}
    for page, min_charts in pages.items():
        state = browser.load(f"{dashboard_url}/{page}", min_charts=min_charts)
        name = (page.split("?")[0] or "overview") + ".png"
        browser.screenshot(shots / name)
        assert state.ready, f"{page or 'overview'}: still running after the timeout"
        assert not state.exceptions, f"{page or 'overview'}: {state.exceptions}"
        assert not state.errors, f"{page or 'overview'}: {state.errors}"
        assert "Page not found" not in state.text, page
        assert len(state.charts) >= min_charts, f"{page or 'overview'}: {len(state.charts)} charts"
        assert not state.empty_charts, (
            f"{page or 'overview'}: empty charts {state.empty_charts}: {state.charts}"
        )
        assert (shots / name).stat().st_size > 10_000


P99_POINTS_JS = """(() => {
  const chart = document.querySelectorAll('[data-testid="stVegaLiteChart"]')[0];
  return Array.from(chart.querySelectorAll('.mark-symbol path')).map(p => {
    const r = p.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; });
})()"""


def test_one_click_on_a_p99_point_opens_the_requests_behind_it(dashboard_url: str, browser: Browser) -> None:
    state = browser.load(f"{dashboard_url}/?window=all", min_charts=PAGES[""])
    assert state.ready and not state.exceptions
    points = browser.evaluate(P99_POINTS_JS)  # the TTFT chart's p99 points
    assert len(points) >= 5
    x, y = points[len(points) // 2]
    for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
        browser.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "/requests" not in browser.evaluate("location.href"):
        time.sleep(0.2)
    url = urlparse(browser.evaluate("location.href"))
    assert url.path == "/requests", url
    q = parse_qs(url.query)
    assert q["sort"] == ["client_ttft_s"] and q["order"] == ["desc"]  # the recording has client TTFT
    assert float(q["ended_until"][0]) > float(q["ended_since"][0])
    state = browser.load(url.geturl())
    assert not state.exceptions
    assert "finished between" in state.text


def test_the_page_check_catches_an_exception_box_and_an_empty_chart(browser: Browser, tmp_path: Path) -> None:
    """The checks above can fail: a page with an exception and an empty chart is caught by both."""
    script = tmp_path / "broken.py"
    script.write_text(
        "import altair as alt, pandas as pd, streamlit as st\n"
        "st.title('broken')\n"
        "df = pd.DataFrame({'x': [1, 2, 3], 'y': [3, 1, 2]})\n"
        "st.altair_chart(alt.Chart(df).mark_line().encode(x='x:Q', y='y:Q'))\n"
        "st.altair_chart(alt.Chart(df.iloc[:0]).mark_line().encode(x='x:Q', y='y:Q'))\n"
        "raise RuntimeError('boom')\n"
    )
    port = free_port()
    cmd = [sys.executable, "-m", "streamlit", "run", str(script), "--server.port", str(port)]
    cmd += ["--server.headless", "true", "--browser.gatherUsageStats", "false"]
    proc = _serve(cmd, f"http://127.0.0.1:{port}/_stcore/health", tmp_path / "st.log")
    try:
        state = browser.load(f"http://127.0.0.1:{port}/")
    finally:
        _stop(proc)
    assert any("boom" in e for e in state.exceptions)
    assert len(state.charts) == 2
    assert state.empty_charts == [1]
