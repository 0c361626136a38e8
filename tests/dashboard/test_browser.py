"""The dashboard in a real browser: ``chunkledger dashboard`` serves it, headless Chromium loads every
page, waits for it to render and takes a screenshot. Over two ledgers: a simulator-recorded run, and a
run recorded from real vLLM (the plugin and the gateway in front, preemptions, a loop-rule cut; replayed,
no vLLM runs here). A page fails on: a Streamlit exception or error box; a chart with nothing drawn in
it (no marks with an area, or a plot squeezed to nothing by its titles); a cut axis title (ellipsised,
drawn past its chart's edge, or longer than its axis); Streamlit's Deploy button or developer menu
items (Rerun, Clear cache) shown to the operator.

Chromium: Debian's ``chromium`` (scripts/test.sh installs it when missing), or CHUNKLEDGER_CHROMIUM.
Screenshots go to CHUNKLEDGER_SCREENSHOTS (default: the test's temporary folder).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlparse

import pytest

from bench.fleet_db import Fleet, build
from bench.toolkit import free_port
from dashboard import fleet
from tests.dashboard.dash_browser import Browser, PageState, find_chromium
from tests.support import ROOT
from tests.support.servers import LedgerServer, stop_group, wait_serving

pytestmark = pytest.mark.slow

DEVELOPER_MENU_ITEMS = ("Rerun", "Clear cache", "Deploy", "Developer", "Settings")

# page -> charts it must draw with the simulator-recorded run (at least)
PAGES = {
    "": 7,  # overview: TTFT, e2e, ITL tails; stacked layers, p99 per layer; two throughput charts
    "requests": 0,
    "kv": 3,
    "cutoffs": 1,
    "advice": 2,
    # a linked what-if (the form's fields from the query, run once): the short-TTFT and ITL bars
    "whatif?"
    + urlencode(
        {
            "sweep": "max_num_batched_tokens=512,1024,4096",
            "recorded": "num_kv_blocks=16384,max_num_seqs=256,reserve_full_isl=false",
            "force": "1",
            "run": "1",
        }
    ): 2,
    "sql": 0,
}


# page -> charts it must draw with the recorded vLLM run (at least): the KV page's preemption chart, KV
# usage and waiting; the run's cutoffs (loop rule, preemption limit) over time; the step-time fit
VLLM_PAGES = {
    "": 7,
    "requests": 0,
    "kv": 3,
    "cutoffs": 1,
    "advice": 2,
    # the recording's engine: a 256-token budget and 16 KV blocks of 128 tokens (tools/record_vllm_run.py)
    "whatif?"
    + urlencode(
        {
            "sweep": "max_num_batched_tokens=128,512",
            "recorded": "max_num_batched_tokens=256,num_kv_blocks=16,block_size=128,reserve_full_isl=false",
            "force": "1",
            "run": "1",
        }
    ): 2,
    "sql": 0,
}


def check_page(state: PageState, page: str, min_charts: int) -> None:
    """What every page must satisfy in the browser."""
    name = page or "overview"
    assert state.ready, f"{name}: still running after the timeout"
    assert not state.exceptions, f"{name}: {state.exceptions}"
    assert not state.errors, f"{name}: {state.errors}"
    assert "Page not found" not in state.text, page
    assert not state.deploy, f"{name}: Streamlit's Deploy button is shown"
    assert state.doc_title.startswith("chunkledger"), state.doc_title
    assert state.favicon.endswith(".png"), f"{name}: favicon {state.favicon!r}"
    assert len(state.charts) >= min_charts, f"{name}: {len(state.charts)} charts, {state.tables} tables"
    assert not state.empty_charts, f"{name}: empty charts {state.empty_charts}: {state.charts}"
    assert not state.cut_texts, f"{name}: cut titles {state.cut_texts}"


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
    wait_serving(proc, url, log)
    return proc


def _dashboard(ledger_url: str, log: Path) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "chunkledger", "dashboard", "--ledger", ledger_url, "--port", str(port)]
    return url, _serve(cmd, f"{url}/_stcore/health", log)


@pytest.fixture(scope="module")
def dashboard_url(recorded_ledger: LedgerServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, proc = _dashboard(recorded_ledger.url, tmp_path_factory.mktemp("dashboard") / "dashboard.log")
    yield url
    stop_group(proc)


@pytest.fixture(scope="module")
def vllm_dashboard_url(vllm_ledger: LedgerServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url, proc = _dashboard(vllm_ledger.url, tmp_path_factory.mktemp("dashboard") / "dashboard.log")
    yield url
    stop_group(proc)


# A fleet small in time but not in engines: 236 engines of 3 models, 8 requests each at once, 4 minutes
# ending now (bench.fleet_db: the read bench's hour, cut short), seen through the 15-minute window.
FLEET_WINDOW = "window=15%20min"
ENGINE_ID = r"engine-\d{3}"


@pytest.fixture(scope="module")
def fleet_dashboard_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("fleet")
    shape = Fleet(engines=236, slots=8, seconds=240, min_steps=600, max_steps=2400, end_ts=time.time())
    build(str(tmp / "fleet.duckdb"), shape)
    ledger = LedgerServer(f"duckdb:///{tmp / 'fleet.duckdb'}", tmp / "ledger.log")
    ledger.start(timeout=120)
    try:
        url, proc = _dashboard(ledger.url, tmp / "dashboard.log")
        yield url
        stop_group(proc)
    finally:
        ledger.stop()


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
        check_page(state, page, min_charts)
        assert (shots / name).stat().st_size > 10_000


def test_every_page_renders_over_a_run_recorded_from_real_vllm(
    vllm_dashboard_url: str, browser: Browser, shots: Path, vllm_api
) -> None:
    """The recorded vLLM run (84 requests, 44 preemptions, 45 min ago: the whole run in one or two
    120 s buckets of the default 1-hour window, as the operator saw it): every page, and the request
    pages of the most preempted request and of the slowest waiter."""
    top = vllm_api.get("/v1/requests", sort="preemptions", order="desc", limit=1, live=False)["rows"][0]
    assert top["preemptions"] > 0
    waiter = vllm_api.get("/v1/requests", sort="backend_wait_s", order="desc", limit=1, live=False)["rows"][0]
    pages = {
        **VLLM_PAGES,
        f"request?id={top['request_id']}": 1,
        f"request?id={waiter['request_id']}": 1,
    }
    for i, (page, min_charts) in enumerate(pages.items()):
        state = browser.load(f"{vllm_dashboard_url}/{page}", min_charts=min_charts)
        name = f"vllm-{page.split('?')[0] or 'overview'}{'-' + str(i) if '?' in page else ''}.png"
        browser.screenshot(shots / name)
        check_page(state, page, min_charts)
        if page == "kv":
            assert "Preemptions" in state.text and "44 preemptions" in state.text
            assert state.tables >= 2  # the preempted requests under the chart; the escape valve
        assert (shots / name).stat().st_size > 10_000
    menu = browser.main_menu()
    assert menu, "the main menu opens"
    assert not [m for m in menu if m.startswith(DEVELOPER_MENU_ITEMS)], menu


def test_a_fleet_of_236_engines_is_drawn_by_model_and_by_its_worst_engines(
    fleet_dashboard_url: str, browser: Browser, shots: Path
) -> None:
    """No chart names more engines than the worst ones drawn on their own: the KV page draws each model
    (its legend: the models), and the worst engines with the rest of each model as one line; the
    overview lists the models. (Before, the KV page had a legend entry per engine.)"""
    state = browser.load(f"{fleet_dashboard_url}/kv?{FLEET_WINDOW}", min_charts=5)
    browser.screenshot(shots / "fleet-kv.png")
    check_page(state, "kv", 5)
    named = state.labels_matching(ENGINE_ID)
    assert max(named) <= fleet.TOP, f"a chart names {max(named)} engines: {named}"
    assert named.count(fleet.TOP) == 2, named  # the KV and waiting charts of the worst engines
    assert sum(n > 0 for n in state.labels_matching(r".+: the other \d+")) == 2  # the rest, per model
    assert "236 engines of 3 models" in state.text
    state = browser.load(f"{fleet_dashboard_url}/?{FLEET_WINDOW}", min_charts=PAGES[""])
    browser.screenshot(shots / "fleet-overview.png")
    check_page(state, "", PAGES[""])
    assert max(state.labels_matching(ENGINE_ID)) == 0
    assert "Engines" in state.text and "worst now: engine-" in state.text


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


def test_the_page_check_catches_exceptions_empty_charts_cut_titles_and_the_developer_menu(
    browser: Browser, tmp_path: Path
) -> None:
    """The checks above can fail. A page served by plain ``streamlit run`` (developer mode: Deploy
    button, Rerun / Clear cache in the menu) with an exception, a chart with no data, a chart whose
    y-axis title is longer than its plot (drawn as the dashboard draws charts: fit-x), and one with
    such a title under Streamlit's default sizing (the title squeezes the plot to nothing, as the KV
    page's preemption chart was), beside a good chart that passes."""
    script = tmp_path / "broken.py"
    script.write_text(
        "import altair as alt, pandas as pd, streamlit as st\n"
        "from dashboard import charts\n"
        "st.title('broken')\n"
        "df = pd.DataFrame({'x': [1, 2, 3], 'y': [3, 1, 2]})\n"
        "line = alt.Chart(df).mark_line()\n"
        "st.altair_chart(charts.sized(line.encode(x='x:Q', y=alt.Y('y:Q', title='fits (s)')), 150))\n"
        "st.altair_chart(alt.Chart(df.iloc[:0]).mark_line().encode(x='x:Q', y='y:Q'))\n"
        "long = alt.Y('y:Q', title='a deliberately far too long axis title for this chart (count)')\n"
        "st.altair_chart(charts.sized(line.encode(x='x:Q', y=long), 150))\n"
        "st.altair_chart(line.encode(x='x:Q', y=long).properties(height=150, title='default sizing'))\n"
        "fleet = pd.DataFrame([{'x': x, 'y': (e * 7 + x) % 10, 'source_id': f'engine-{e:03d}'}\n"
        "                      for e in range(236) for x in range(3)])\n"
        "st.altair_chart(charts.sized(alt.Chart(fleet).mark_line().encode(\n"
        "    x='x:Q', y='y:Q', color=alt.Color('source_id:N', legend=alt.Legend(orient='bottom'))), 150))\n"
        "raise RuntimeError('boom')\n"
    )
    port = free_port()
    cmd = [sys.executable, "-m", "streamlit", "run", str(script), "--server.port", str(port)]
    cmd += ["--server.headless", "true", "--browser.gatherUsageStats", "false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        cmd,
        stdout=(tmp_path / "st.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=env,
    )
    try:
        wait_serving(proc, f"http://127.0.0.1:{port}/_stcore/health", tmp_path / "st.log")
        state = browser.load(f"http://127.0.0.1:{port}/", min_charts=5)
        menu = browser.main_menu()
    finally:
        stop_group(proc)
    assert any("boom" in e for e in state.exceptions)
    assert len(state.charts) == 5
    assert state.empty_charts == [1, 3]  # no data; a plot squeezed to nothing
    cut = {(i, why) for i, _, why in state.cut_texts}
    assert (2, "longer than its axis") in cut
    assert 3 in {i for i, _ in cut}
    assert 0 not in {i for i, _ in cut}  # the short title fits
    assert state.labels_matching(ENGINE_ID)[4] > 3 * fleet.TOP  # a legend entry per engine is caught
    assert state.labels_matching(ENGINE_ID)[:4] == [0, 0, 0, 0]
    assert state.deploy
    assert [m for m in menu if m.startswith(DEVELOPER_MENU_ITEMS)]
