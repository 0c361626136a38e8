"""vLLM's OpenAI server on CPU: the model in a worker process (vLLM's default) or in the engine core.

With the multiproc executor the engine core waits for each step's reply by spinning on shared memory
with ``sched_yield``; on a small host that spin takes a core from everything else. Each row starts the
API server (tiny random-weight Llama, 4 layers, one OpenMP thread, the dtype engine_settings picks),
streams a runaway answer (2,048 tokens, EOS ignored) and shorts at ``--rps`` (64-token prompts, 24
tokens out) for ``--seconds``, while a probe process sleeps 10 ms at a time and records how late it
wakes: the longest time the host left a sleeping process unscheduled. Rows alternate (mp, uni, mp, uni
...) so that both see the same machine.

    .venv/bin/python -m bench.cpu_executor                  # 2 rounds, 12 s of load each
    .venv/bin/python -m bench.cpu_executor --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.toolkit import Proc, free_port, percentile, vllm_server_cmd

ROOT = Path(__file__).resolve().parent.parent

EXECUTORS = {
    "mp": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, []),
    "uni": ({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, ["--distributed-executor-backend", "uni"]),
}


def _probe(seconds: float, out: Any) -> None:
    gaps = []
    end = time.monotonic() + seconds
    last = time.monotonic()
    while last < end:
        time.sleep(0.01)
        now = time.monotonic()
        gaps.append(now - last - 0.01)
        last = now
    out.put(gaps)


def run_row(model: str, executor: str, rps: float, seconds: float, seed: int) -> dict[str, Any]:
    from engine_hooks.vllm.cpu import engine_settings
    from engine_hooks.vllm.tiny_model import vllm_env

    settings = engine_settings(environ={})
    extra_env, extra_args = EXECUTORS[executor]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="clexec-", dir="/tmp") as tmp:
        env = {**os.environ, **vllm_env(tmp), **settings.env, **extra_env}
        env.pop("CHUNKLEDGER_URL", None)
        args = [a for a in settings.cli_args() if a not in ("--distributed-executor-backend", "uni")]
        cmd = vllm_server_cmd(
            model,
            port,
            served_name="tiny",
            engine_args=args,
            plugin=False,
            max_model_len=4096,
            kv_cache_memory_bytes=256 << 20,
            max_num_seqs=64,
            max_num_batched_tokens=256,
            extra=extra_args,
        )
        server = Proc("vllm", cmd, Path(tmp) / "server.log", env)
        try:
            url = f"http://127.0.0.1:{port}"
            server.wait_ready(f"{url}/health", 300)
            return _load(url, rps, seconds, seed)
        finally:
            server.stop()


def _load(url: str, rps: float, seconds: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    client = httpx.Client(base_url=url, timeout=600)
    ttfts: list[float] = []
    threads: list[threading.Thread] = []

    def go(body: dict[str, Any], record: bool) -> None:
        t0 = time.monotonic()
        body = {**body, "model": "tiny", "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            first = None
            for line in r.iter_lines():
                if first is None and line.startswith("data: "):
                    first = time.monotonic() - t0
        if record and first is not None:
            ttfts.append(first)

    def fire(body: dict[str, Any], record: bool) -> None:
        t = threading.Thread(target=go, args=(body, record), daemon=True)
        t.start()
        threads.append(t)

    queue: Any = multiprocessing.get_context("spawn").Queue()
    probe = multiprocessing.get_context("spawn").Process(target=_probe, args=(seconds, queue))
    probe.start()
    runaway = [rng.randrange(10, 1300) for _ in range(32)]
    fire({"prompt": runaway, "max_tokens": 2048, "ignore_eos": True}, False)
    t0 = time.monotonic()
    at = rng.expovariate(rps)
    while at < seconds:
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        fire({"prompt": [rng.randrange(10, 1300) for _ in range(64)], "max_tokens": 24}, True)
        at += rng.expovariate(rps)
    gaps = queue.get(timeout=seconds + 120)
    probe.join(10)
    for t in threads:
        t.join(120)
    client.close()
    return {
        "shorts": len(ttfts),
        "ttft_p50_ms": percentile(ttfts, 0.5) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 0.99) * 1e3,
        "probe_max_gap_ms": max(gaps) * 1e3,
        "probe_gaps_over_100ms": sum(1 for g in gaps if g > 0.1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rps", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    from engine_hooks.vllm.cpu import engine_settings
    from engine_hooks.vllm.tiny_model import build_tiny_model

    print(engine_settings(environ={}).describe())
    rows = []
    with tempfile.TemporaryDirectory(prefix="clexec-model-") as d:
        model = str(build_tiny_model(Path(d) / "tiny", layers=4))
        for r in range(ns.rounds):
            for name in EXECUTORS:
                row = {"executor": name, "round": r, **run_row(model, name, ns.rps, ns.seconds, seed=r)}
                rows.append(row)
                print(
                    f"{name:>4} round {r}: shorts {row['shorts']}, TTFT p50 {row['ttft_p50_ms']:.0f} ms "
                    f"p99 {row['ttft_p99_ms']:.0f} ms; probe: longest unscheduled "
                    f"{row['probe_max_gap_ms']:.0f} ms, {row['probe_gaps_over_100ms']} wake-ups "
                    "over 100 ms late",
                    flush=True,
                )
    if ns.json:
        Path(ns.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
