"""The plugin against each tested vLLM release's own scheduler and engine core (GPU releases included),
each in its own process with that release's Python source first on ``PYTHONPATH``.

* The version matrix (``scripts/vllm_matrix.sh``): the plugin's scheduler-level tests over the
  synthetic device, with async scheduling on (GPU's default) and off, and Model Runner V2's shape
  where the release has the switch. The cells run here: every release with async scheduling on, each
  GPU release's lock-step too, and 0.33 in both runner shapes (V2 is its default on GPU). 0.32 in
  lock-step is the release the CPU engine tests run on (``tests/engine_hooks/vllm``).
* The referee (``scripts/vllm_referee.sh``): each release's own scheduler tests with the plugin's
  classes in vLLM's place, the hooks on and reporting to a real ledger (less the baseline,
  ``tests/vllm_referee/baseline-<version>.txt``: the tests that fail here with vLLM's classes too).

Each cell fetches its release's source once (``python -m tools.vllm_sources``, about 50 MB).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tools.vllm_sources import TESTED

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CELLS = [  # (release, async scheduling, Model Runner V2)
    ("0.32.0", 1, 0),
    ("0.33.0", 1, 1),
    ("0.33.0", 0, 0),
    ("0.34.0", 1, 0),
    ("0.34.0", 0, 0),
]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def _summary(out: str) -> str:
    lines = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    return lines[-1] if lines else "(no pytest summary)"


def _command(run: tuple[str | int, ...]) -> list[str]:
    if run[0] == "matrix":
        return ["bash", "scripts/vllm_matrix.sh", *(str(part) for part in run[1:])]
    return ["bash", "scripts/vllm_referee.sh", str(run[1])]


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Iterator[dict[tuple[str | int, ...], Future]]:
    """Every selected cell and referee, started at once two at a time: this process only waits on
    them, so both cores work. The releases' sources are fetched first, one at a time."""
    wanted: list[tuple[str | int, ...]] = []
    for item in request.session.items:
        params = getattr(item, "callspec", None)
        if item.module is not request.module or params is None:
            continue
        p = params.params
        wanted.append(
            ("matrix", p["version"], p["overlap"], p["mrv2"]) if "overlap" in p else ("referee", p["version"])
        )
    fetch = [sys.executable, "-m", "tools.vllm_sources", *sorted({str(run[1]) for run in wanted})]
    subprocess.run(fetch, cwd=ROOT, check=True, capture_output=True, timeout=900)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {run: pool.submit(_run, _command(run), 900) for run in wanted}
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.parametrize(
    ("version", "overlap", "mrv2"), CELLS, ids=[f"{v}-async{o}-mrv2{m}" for v, o, m in CELLS]
)
def test_the_plugin_tests_pass_on_each_release_with_and_without_overlap(runs, version, overlap, mrv2):
    done = runs[("matrix", version, overlap, mrv2)].result()
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{_summary(out)}\n{out[-6000:]}"
    passed = int(re.search(r"(\d+) passed", _summary(out)).group(1))  # type: ignore[union-attr]
    assert passed >= 80 and "failed" not in _summary(out), _summary(out)


def test_the_matrix_covers_the_range_the_plugin_states():
    from engine_hooks.vllm import compat

    (first, last), minors = compat.TESTED, [compat.release(v) for v in TESTED]
    assert minors == [(first[0], m) for m in range(first[1], last[1] + 1)], (TESTED, compat.TESTED)
    assert {v for v, _, _ in CELLS} == set(TESTED)


@pytest.mark.parametrize("version", TESTED)
def test_vllms_own_scheduler_tests_pass_with_the_plugins_classes(runs, version):
    done = runs[("referee", version)].result()
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{_summary(out)}\n{out[-6000:]}"
    assert re.search(r"referee \(ledger classes\): .*\b[1-9]\d* names swapped", out), out[-2000:]
    assert " 0 hook errors" in out, out[-2000:]
