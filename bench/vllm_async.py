"""What the plugin costs the engine thread of a GPU-sized batch, per vLLM release and scheduling mode.

GPU vLLM cannot run here, but its engine core and scheduler are pure Python: this runs a release's own
``EngineCore`` (``.cache/vllm/<version>``, :mod:`tools.vllm_sources`) over the synthetic device of
``tests/engine_hooks/vllm/synthetic.py``, whose steps take ``--device-ms`` on the real clock (default
30 ms, a GPU decode step at this batch size) while the engine thread waits for them with the GIL
released, as it waits for a GPU. Side by side in one process, rounds alternated: vLLM's own class and
chunkledger's (hooks on, reporting to a real ledger, ``chunkledger serve --db null://``), each with
async scheduling on (``AsyncScheduler`` / ``AsyncLedgerScheduler``, the GPU default) and off. Each
round runs 256 requests to a full batch of decodes and times the decode-only steps. Printed per mode:
vLLM's µs per step, what the plugin adds to it (wall time, and the engine thread's CPU time), the
hooks' own time per step on the engine thread (``hook_seconds``: wall, so waits for the GIL count;
``hook_cpu_seconds``: its CPU time) and the CPU time of folding the outputs on the folder's thread
(:mod:`engine_hooks.vllm.folding`), which a GPU's wait hides. Goal: hooks at most 300 µs per step at
256 running (1 % of a 30 ms GPU decode step).

``--device-ms 0``: the device takes no time and the engine thread never waits, so its step is its own
CPU work alone; the folder's thread then competes with it for the GIL (no engine runs that way).

    .venv/bin/python -m bench.vllm_async                      # every cached release, about 2 minutes each
    .venv/bin/python -m bench.vllm_async --versions 0.34.0 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gateway import wait_ready
from bench.toolkit import free_port

ROOT = Path(__file__).resolve().parent.parent
LEDGER_CLASS = "engine_hooks.vllm.LedgerScheduler"  # built as AsyncLedgerScheduler under async scheduling
VLLM_CLASS = {  # vLLM's own class for each mode, as vLLM picks it
    True: "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
    False: "vllm.v1.core.sched.scheduler.Scheduler",
}


def child(args: argparse.Namespace) -> None:
    """One release (first on PYTHONPATH): four engines, ``rounds`` alternated rounds, JSON on stdout."""
    import logging

    logging.disable(logging.WARNING)
    import random

    import vllm

    from engine_hooks.vllm.tiny_model import build_tiny_model, vllm_env
    from tests.engine_hooks.vllm.synthetic import SyntheticEngine

    work = Path(args.workdir)
    os.environ.update(vllm_env(work / "env"))
    model = build_tiny_model(work / "tiny-llama")
    engines: dict[tuple[str, bool], Any] = {}
    device: dict[str, Any] = {}
    if args.device_ms > 0:  # a GPU-shaped device: each step takes device_ms, the engine thread waits
        step_s = args.device_ms / 1e3
        device = {"real_time": True, "device_time": lambda output: step_s}
    for overlap in (True, False):
        for name, cls in (("vllm", VLLM_CLASS[overlap]), ("ledger", LEDGER_CLASS)):
            if name == "ledger":
                os.environ.update(CHUNKLEDGER_URL=args.url, CHUNKLEDGER_SOURCE_ID=f"bench-{overlap}")
            else:
                os.environ.pop("CHUNKLEDGER_URL", None)
            engines[(name, overlap)] = SyntheticEngine(
                model,
                overlap=overlap,
                budget=args.budget,
                kv_tokens=args.running * (args.prompt + args.output + 256),
                max_num_seqs=args.running,
                scheduler_cls=cls,
                clocked=False,
                **device,
            )
    rng = random.Random(0)
    results: dict[str, dict[str, list[float]]] = {
        f"{name}/{overlap}": {"step_us": [], "cpu_us": [], "hook_us": [], "hook_cpu_us": [], "fold_us": []}
        for name, overlap in engines
    }
    order = list(engines)
    for r in range(args.rounds):
        for key in order[r % len(order) :] + order[: r % len(order)]:
            eng = engines[key]
            for i in range(args.running):
                tokens = [rng.randrange(10, 1300) for _ in range(args.prompt)]
                eng.add(f"r{r}-{i}-{rng.random()}", tokens, max_tokens=args.output)
            sch = eng.scheduler
            times, cpu, hooks, hooks_cpu = [], [], [], []
            folder = getattr(sch, "_cl_folder", None)
            folded = (folder.cpu_seconds, folder.folded) if folder is not None else (0.0, 0)
            while eng.core.has_unfinished_requests():
                full = len(sch.running) == args.running and not sch.waiting
                h0 = getattr(sch, "hook_seconds", 0.0)
                hc0 = getattr(sch, "hook_cpu_seconds", 0.0)
                t0, c0 = time.perf_counter(), time.thread_time()
                eng.step()
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                if full and all(not req.is_prefill_chunk for req in sch.running):
                    times.append(dt)
                    cpu.append(dc)
                    hooks.append(getattr(sch, "hook_seconds", 0.0) - h0)
                    hooks_cpu.append(getattr(sch, "hook_cpu_seconds", 0.0) - hc0)
            row = results[f"{key[0]}/{key[1]}"]
            row["step_us"].append(statistics.median(times) * 1e6)
            row["cpu_us"].append(statistics.median(cpu) * 1e6)
            row["hook_us"].append(statistics.mean(hooks) * 1e6)
            row["hook_cpu_us"].append(statistics.mean(hooks_cpu) * 1e6)
            if folder is not None and folder.folded > folded[1]:  # the folder thread's CPU per fold
                row["fold_us"].append((folder.cpu_seconds - folded[0]) / (folder.folded - folded[1]) * 1e6)
    for eng in engines.values():
        eng.close()
    print(json.dumps({"version": vllm.__version__, "results": results}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--versions", nargs="*", default=None, help="releases (default: every one cached)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--running", type=int, default=256, help="requests decoding together")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument(
        "--device-ms",
        type=float,
        default=30.0,
        help="each step's device time on the real clock, the engine thread waiting for it as for a GPU "
        "(default: the goal's 30 ms decode step; 0: the device takes none, the engine thread never waits)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from tools.vllm_sources import TESTED, fetch

    versions = args.versions or list(TESTED)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-async-") as tmp:
        serve = [str(Path(sys.executable).with_name("chunkledger")), "serve", "--db", "null://"]
        ledger = subprocess.Popen(
            [*serve, "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=tmp,
        )
        try:
            wait_ready(f"http://127.0.0.1:{port}/readyz", ledger)
            device = f"a {args.device_ms:g} ms device step" if args.device_ms > 0 else "device free"
            print(
                f"{args.running} running, {args.prompt}-token prompts, {args.output} output tokens, "
                f"{args.rounds} rounds; median decode-only step (engine-thread wall time, {device})"
            )
            for version in versions:
                src = fetch(version)
                env = {**os.environ, "PYTHONPATH": f"{src}:{ROOT}", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
                cmd = [sys.executable, "-m", "bench.vllm_async", "--child", "--workdir", tmp]
                cmd += ["--url", f"http://127.0.0.1:{port}"]
                for flag in ("rounds", "running", "prompt", "output", "budget", "device_ms"):
                    cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
                out = subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, text=True)
                _report(version, json.loads(out.stdout.strip().splitlines()[-1]))
        finally:
            ledger.terminate()
            ledger.wait(10)


def _report(version: str, data: dict[str, Any]) -> None:
    res = data["results"]
    for overlap in (True, False):
        vllm_, ours = res[f"vllm/{overlap}"], res[f"ledger/{overlap}"]
        wall = statistics.median(ours["step_us"]) - statistics.median(vllm_["step_us"])
        cpu = statistics.median(ours["cpu_us"]) - statistics.median(vllm_["cpu_us"])
        hook = statistics.median(ours["hook_us"])
        hook_cpu = statistics.median(ours["hook_cpu_us"])
        fold = statistics.median(ours["fold_us"]) if ours["fold_us"] else 0.0
        mode = "async" if overlap else "sync "
        print(
            f"vllm {version} {mode}: vLLM {statistics.median(vllm_['step_us']):6.0f} us/step; "
            f"chunkledger adds {wall:+5.0f} us wall, {cpu:+5.0f} us engine-thread CPU; "
            f"hooks {hook:4.0f} us/step wall [{'ok' if hook <= 300 else 'over'}: goal 300 us], "
            f"{hook_cpu:4.0f} us CPU; folding off it {fold:4.0f} us CPU/step"
        )


if __name__ == "__main__":
    main()
