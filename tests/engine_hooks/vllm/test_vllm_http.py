"""Through vLLM's OpenAI HTTP server (multiprocess engine): the scheduler class loads in the engine
process, reports to the ledger, and a ledger abort reaches the HTTP client as finish_reason abort."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from bench.toolkit import free_port, vllm_server_cmd
from engine_hooks.events import Command, CutoffApplied, Finished, Queued
from engine_hooks.vllm.cpu import engine_settings
from engine_hooks.vllm.tiny_model import vllm_env
from tests.support.fake_ledger import FakeLedger, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.needs_model]  # a real model and front end


@pytest.fixture
def server(tiny_model: str, tmp_path: Path):
    ledger = FakeLedger()
    port = free_port()
    settings = engine_settings()
    env = {
        **os.environ,
        **vllm_env(tmp_path / "env"),
        **settings.env,
        "CHUNKLEDGER_URL": ledger.url,
        "CHUNKLEDGER_SOURCE_ID": "vllm-http-test",
        "CHUNKLEDGER_SPOOL_DIR": str(tmp_path / "spool"),
        "CHUNKLEDGER_SPOOL_FSYNC": "0",
    }
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        vllm_server_cmd(
            tiny_model,
            port,
            served_name="tiny",
            engine_args=settings.cli_args(),
            kv_cache_memory_bytes=64 << 20,
            max_num_batched_tokens=128,
            max_model_len=4096,
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {(tmp_path / 'server.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise AssertionError(f"server not ready: {(tmp_path / 'server.log').read_text()[-3000:]}")
        yield url, ledger, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        ledger.stop()


def _descendants(pid: int) -> list[str]:
    """The command lines (process titles) of every process below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        try:
            out.append((Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
        todo += children.get(child, [])
    return out


def test_api_server_with_the_machines_settings_runs_the_model_in_the_engine_core(server):
    # engine_settings() on CPU: no worker process for the engine core to busy-wait on each step
    # (a core burnt, other processes stalled for seconds on a 2-core host).
    _, _, pid = server
    titles = _descendants(pid)
    assert any("EngineCore" in t for t in titles), titles
    assert not any("Worker" in t for t in titles), titles


def test_abort_command_reaches_the_http_client_as_finish_reason_abort(server):
    url, ledger, _ = server
    rid = "http-runaway-1"
    body = {
        "model": "tiny",
        "prompt": "the engine token prefill decode chunk budget",
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": {"chunkledger_request_id": rid},
    }
    # The ledger has already decided (e.g. a loop rule on the gateway's side): the command comes back
    # with the first ingest answer after the engine reports the request, and is applied in the engine.
    ledger.commands = [Command(id="http-cmd-1", request_id=rid, action="abort", rule="loop")]
    finish = stop = None
    pieces = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            pieces += 1
            if choice.get("finish_reason"):
                finish, stop = choice["finish_reason"], choice.get("stop_reason")
    assert finish == "abort"
    assert stop == "chunkledger:loop"
    assert pieces < 3000

    def seen(kind: type) -> list:
        return [e for e in ledger.store.events if isinstance(e, kind) and e.request_id == rid]

    assert wait_until(lambda: bool(seen(Finished)), 15.0)
    assert len(seen(Queued)) == 1 and len(seen(CutoffApplied)) == 1
    (fin,) = seen(Finished)
    assert fin.reason == "cutoff" and fin.stop_reason == "chunkledger:loop"
    assert {sid for sid, _, _ in ledger.rows} == {"vllm-http-test"}
