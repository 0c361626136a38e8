"""What the benchmarks share, defined once: the ledger's percentile (so a bench's p99 is the ledger's
p99), free ports, a process's resident memory, and child processes in a process group of their own (vLLM
forks its engine core) that stop as a group."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from ledger.analytics.common import percentile as _percentile_sorted

if TYPE_CHECKING:
    from engine_hooks.vllm.cpu import EngineSettings

ROOT = Path(__file__).resolve().parent.parent


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` as the ledger computes it (``ledger.analytics.common``:
    linear interpolation between the closest ranks, SQL's ``percentile_cont``); NaN for no values."""
    xs = sorted(values)
    return _percentile_sorted(xs, q) if xs else math.nan


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss(pid: int) -> int:
    """Resident memory of process ``pid`` in bytes (Linux), 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def vllm_server_cmd(
    model: str,
    port: int,
    *,
    served_name: str,
    engine_args: Sequence[str] = (),
    plugin: bool = True,
    extra: Sequence[str] = (),
    **options: int | str | bool | None,
) -> list[str]:
    """vLLM's OpenAI server on ``port`` run by this interpreter, eager (no graph capture on CPU), with
    ``engine_args`` (``EngineSettings.cli_args()``), the chunkledger scheduler plugin unless ``plugin``
    is false, and ``options`` as flags (``max_num_seqs=64`` -> ``--max-num-seqs 64``; True: the flag
    alone; False or None: left out), then ``extra`` as given."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--served-model-name", served_name, "--port", str(port), "--enforce-eager", *engine_args]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False and value is not None:
            cmd += [flag, str(value)]
    if plugin:
        cmd += ["--scheduler-cls", "engine_hooks.vllm.LedgerScheduler"]
    return [*cmd, *extra]


def in_process_vllm(workdir: str | os.PathLike[str]) -> EngineSettings:
    """This process made ready to run vLLM's ``LLM`` in it, as the bench workers do: the host's engine
    settings (:func:`engine_hooks.vllm.cpu.engine_settings`: fp32 without native bf16, one OpenMP thread
    fewer than the cores) with their threads applied, vLLM's caches and sockets under ``workdir``, the
    engine core in this process and vLLM's warnings off. Returns the settings for ``LLM(...)``
    (``settings.llm_kwargs()``). Call before vLLM is imported."""
    import logging

    from engine_hooks.vllm.cpu import engine_settings
    from engine_hooks.vllm.tiny_model import vllm_env

    settings = engine_settings()
    settings.apply_threads()
    os.environ.update(vllm_env(workdir))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    logging.disable(logging.WARNING)
    return settings


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class Proc:
    """A child in its own process group (vLLM forks its engine core): stopped as a group."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        logfile: Path,
        env: dict[str, str],
        stdin: int | None = None,
        cwd: Path | str = ROOT,
    ):
        self.name, self.cmd, self.logfile = name, cmd, logfile
        self._log = open(logfile, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

    def tail(self, n: int = 3000) -> str:
        """The log's end, after its first lines naming an error (vLLM's root cause comes early)."""
        try:
            text = self.logfile.read_text(errors="replace")
        except OSError:
            return ""
        errors = [line for line in text.splitlines() if "Error: " in line][:3]
        return "\n".join([*errors, "...", text[-n:]]) if errors else text[-n:]

    def wait_ready(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready in {timeout:.0f} s ({url}):\n{self.tail()}")
            time.sleep(0.25)

    def go(self) -> None:
        """Close the child's stdin (the client driver starts when it reads EOF)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

    def stop(self) -> None:
        pgid = self.proc.pid
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                self.proc.wait(10)
        # what the leader left behind in its group (a PID is not reused while its group lives)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, 0)
            os.killpg(pgid, signal.SIGKILL)
        self.go()
        self._log.close()


def stop_all(procs: list[Proc], work: Path, *, keep: bool, log: Callable[[str], None] = say) -> None:
    """Stop the children, newest first (one failing does not keep the others running), then remove
    the work folder unless asked to keep it."""
    for p in reversed(procs):
        try:
            p.stop()
        except Exception as exc:  # keep stopping the others
            log(f"stopping {p.name}: {exc}")
    if keep:
        log(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
