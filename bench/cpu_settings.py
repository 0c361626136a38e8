"""vLLM on CPU: step times by dtype and OpenMP threads, side by side, with a busy process beside it.

Each row runs one in-process engine (tiny random-weight Llama, hidden 128 x 2 layers) in its own
process with ``OMP_NUM_THREADS`` set, while one CPU-burning process runs for the whole bench (what the
ledger, gateway or a client are to the engine on a small host). Printed per row: a one-decode step,
a 32-decode step (p50 of the decode steps) and a 4096-token prefill.

    .venv/bin/python -m bench.cpu_settings                 # float32/1, float32/2, auto/1 threads
    .venv/bin/python -m bench.cpu_settings --no-burner      # the same on an otherwise idle machine
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

from engine_hooks.vllm.cpu import DType

ROOT = Path(__file__).resolve().parent.parent

ROWS = (("float32", 1), ("float32", 2), ("auto", 1))


def worker(model: str, dtype: str, workdir: str) -> None:
    from engine_hooks.vllm.tiny_model import vllm_env

    os.environ.update(vllm_env(workdir))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import logging

    logging.disable(logging.WARNING)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model,
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=4096,
        max_model_len=8192,
        dtype=cast("DType", dtype),  # a row of ROWS: vLLM's own dtype names
        enable_prefix_caching=False,
    )
    eng = llm.llm_engine
    rng = random.Random(0)

    def run(prompts: list[int], max_tokens: int) -> list[float]:
        for i, n in enumerate(prompts):
            tokens = [rng.randrange(10, 1300) for _ in range(n)]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            eng.add_request(f"r{time.monotonic()}-{i}", TokensPrompt(prompt_token_ids=tokens), params)
        times = []
        while eng.has_unfinished_requests():
            t = time.monotonic()
            eng.step()
            times.append(time.monotonic() - t)
        return times

    run([64], 4)  # warm-up
    one = sorted(run([32], 40)[2:])
    many = sorted(run([32] * 32, 40)[2:])
    t = time.monotonic()
    run([4096], 1)
    prefill = time.monotonic() - t
    out = {"dtype": dtype, "threads": torch.get_num_threads()}
    out.update(
        decode1_ms=one[len(one) // 2] * 1e3, decode32_ms=many[len(many) // 2] * 1e3, prefill4k_s=prefill
    )
    print(json.dumps(out), flush=True)


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-burner", action="store_true", help="no CPU-burning process beside the engine")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    from engine_hooks.vllm.tiny_model import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="chunkledger-cpu-"))
    model = build_tiny_model(tmp / "model", hidden=128, layers=2)
    burner = None
    if not args.no_burner:
        burner = multiprocessing.Process(target=_burn, args=(1800.0,), daemon=True)
        burner.start()
    rows = []
    try:
        for dtype, threads in ROWS:
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
            cmd = [sys.executable, __file__, "--worker", model, dtype, str(tmp / f"{dtype}-{threads}")]
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                print(f"{dtype}/{threads}: failed (exit {proc.returncode})", flush=True)
                continue
            rows.append(json.loads(lines[-1]))
    finally:
        if burner is not None:
            burner.terminate()
    print(f"vLLM on CPU, tiny Llama 128 x 2, {'one busy process beside it' if burner else 'idle machine'}:")
    print(f"  {'dtype':8} {'threads':>7} {'1 decode ms':>12} {'32 decodes ms':>14} {'4k prefill s':>13}")
    for r in rows:
        print(
            f"  {r['dtype']:8} {r['threads']:>7} {r['decode1_ms']:>12.1f} {r['decode32_ms']:>14.1f} "
            f"{r['prefill4k_s']:>13.2f}"
        )


if __name__ == "__main__":
    main()
