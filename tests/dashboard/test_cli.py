"""``chunkledger dashboard``: options and refusals (serving is covered by test_browser.py)."""

from __future__ import annotations

from typer.testing import CliRunner

from chunkledger.dashboard import APP, streamlit_command, streamlit_env
from chunkledger.main import app

runner = CliRunner()


def test_dashboard_command_is_registered_with_its_options() -> None:
    out = runner.invoke(app, ["dashboard", "--help"])
    assert out.exit_code == 0
    for option in ("--ledger", "--port", "--read-token", "--refresh-s"):
        assert option in out.output


def test_dashboard_refuses_a_ledger_that_is_not_an_http_url() -> None:
    out = runner.invoke(app, ["dashboard", "--ledger", "127.0.0.1:8321"])
    assert out.exit_code == 2
    assert "--ledger" in out.output and "not an http(s) URL" in out.output


def test_dashboard_runs_streamlit_headless_on_the_port_asked() -> None:
    cmd = streamlit_command(8600, "127.0.0.1")
    assert cmd[1:4] == ["-m", "streamlit", "run"]
    assert cmd[4].endswith("dashboard/app.py")
    assert cmd[cmd.index("--server.port") + 1] == "8600"
    assert cmd[cmd.index("--server.headless") + 1] == "true"


def test_dashboard_hides_streamlits_deploy_button_and_developer_menu() -> None:
    """``chunkledger dashboard`` passes toolbarMode viewer, and the config next to app.py says the same
    for ``streamlit run dashboard/app.py`` from any working directory."""
    import tomllib
    from pathlib import Path

    import dashboard

    cmd = streamlit_command(8600, "127.0.0.1")
    assert cmd[cmd.index("--client.toolbarMode") + 1] == "viewer"
    package = Path(dashboard.__file__).parent
    config = tomllib.loads((package / ".streamlit" / "config.toml").read_text())
    assert config["client"]["toolbarMode"] == "viewer"
    assert (package / "favicon.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_dashboard_that_runs_is_ours_even_beside_a_users_dashboard_package(tmp_path) -> None:
    """Started from a folder holding a ``dashboard`` package of the user's own, Streamlit's process
    (started with ``python -m``, which puts the working directory first) still imports this one."""
    import os
    import subprocess
    import sys

    (tmp_path / "dashboard").mkdir()
    (tmp_path / "dashboard" / "__init__.py").write_text("raise SystemExit('the user package ran')\n")
    code = "import dashboard, ledger.client; print(dashboard.__file__)"
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=streamlit_env(os.environ),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(APP.with_name("__init__.py"))
