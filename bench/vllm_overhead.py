"""What the vLLM plugin costs: the same workload on vLLM with and without LedgerScheduler, alternated.

Three engine processes are started side by side (vLLM in-process mode inside each, tiny random-weight
Llama, CPU): one with vLLM's own Scheduler, two with ``engine_hooks.vllm.LedgerScheduler`` reporting
to a real ledger (``chunkledger serve --db null://``: the full HTTP ingest path, no storage), one
with its defaults (``tokens`` events) and one with ``step_tokens`` (the tokens on the step events).
The parent asks them in turn (rotating the order) to run one round of the same seeded workload, so
that machine noise hits all alike, and prints the output tokens/s ratio (plugin / vanilla, median of
rounds), the p99 step time ratio (all steps pooled) and the hooks' engine-thread time per step.
Goal: ratios >= 0.99 and <= 1.01.

    .venv/bin/python -m bench.vllm_overhead                    # about a minute or two
    .venv/bin/python -m bench.vllm_overhead --rounds 6 --requests 48
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.toolkit import free_port, in_process_vllm, percentile

ROOT = Path(__file__).resolve().parent.parent


# -- worker: one engine, one round per "run" line on stdin -------------------------------------------


def worker(args: argparse.Namespace) -> None:
    settings = in_process_vllm(args.workdir)  # fp32 without native bf16, one OpenMP thread fewer
    from vllm import LLM, RequestOutput, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        args.model,
        **settings.llm_kwargs(),
        enforce_eager=True,
        kv_cache_memory_bytes=256 << 20,
        max_num_batched_tokens=args.budget,
        max_model_len=2048,
        max_num_seqs=64,
        enable_prefix_caching=False,
        scheduler_cls="engine_hooks.vllm.LedgerScheduler" if args.plugin else None,
    )
    engine = llm.llm_engine
    rng = random.Random(args.seed)
    workload = [[rng.randrange(10, 1300) for _ in range(rng.randint(64, 512))] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    from engine_hooks.vllm.scheduler import iter_schedulers

    schedulers = list(iter_schedulers(llm))
    print("ready", flush=True)
    for n, line in enumerate(sys.stdin):
        if line.strip() != "run":
            break
        for i, tokens in enumerate(workload):
            engine.add_request(f"r{n}-{i}", TokensPrompt(prompt_token_ids=tokens), params)
        steps: list[float] = []
        out_tokens = 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = [o for o in engine.step() if isinstance(o, RequestOutput)]
            steps.append(time.perf_counter() - t0)
            out_tokens += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        wall = time.perf_counter() - start
        hook = sum(s.hook_seconds for s in schedulers)
        for s in schedulers:
            s.hook_seconds = 0.0
        result = {"tokens_per_s": out_tokens / wall, "steps": steps, "tokens": out_tokens, "hook_s": hook}
        print(json.dumps(result), flush=True)


# -- parent ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=4, help="measured rounds per engine (after one warm-up)"
    )
    parser.add_argument("--requests", type=int, default=32, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=48, help="output tokens per request")
    parser.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plugin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from engine_hooks.vllm.tiny_model import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="chunkledger-vllm-overhead-"))
    model = build_tiny_model(tmp / "model", hidden=args.hidden, layers=args.layers, heads=4)
    port = free_port()
    ledger_log = open(tmp / "ledger.log", "wb")  # noqa: SIM115 - closed at the end
    ledger = subprocess.Popen(
        [sys.executable, "-m", "chunkledger", "serve", "--db", "null://", "--port", str(port)],
        stdout=ledger_log,
        stderr=subprocess.STDOUT,
    )
    base = [sys.executable, __file__, "--worker", "--model", model, "--seed", str(args.seed)]
    base += [
        "--requests",
        str(args.requests),
        "--max-tokens",
        str(args.max_tokens),
        "--budget",
        str(args.budget),
    ]
    env = {
        **os.environ,
        "CHUNKLEDGER_URL": f"http://127.0.0.1:{port}",
        "CHUNKLEDGER_SOURCE_ID": f"bench-overhead-{port}",
        "CHUNKLEDGER_SPOOL_DIR": str(tmp / "spool"),
    }
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, extra, more_env in (
            ("vanilla", [], {}),
            ("plugin", ["--plugin"], {}),
            ("plugin-steps", ["--plugin"], {"CHUNKLEDGER_VLLM_STEP_TOKENS": "1"}),
        ):
            procs[name] = subprocess.Popen(
                [*base, *extra, "--workdir", str(tmp / name)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(tmp / f"{name}.log", "w"),  # noqa: SIM115
                text=True,
                env={**env, **more_env, "CHUNKLEDGER_SOURCE_ID": f"bench-overhead-{port}-{name}"},
            )
        for name, proc in procs.items():
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                raise SystemExit(f"{name} engine failed to start; see {tmp / (name + '.log')}")
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in procs}
        names = list(procs)
        for r in range(args.rounds + 1):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                proc = procs[name]
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write("run\n")
                proc.stdin.flush()
                result = json.loads(proc.stdout.readline())
                if r:  # round 0 warms both up
                    results[name].append(result)
    finally:
        for proc in procs.values():
            if proc.stdin:
                proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        ledger.terminate()
        ledger.wait(30)
        ledger_log.close()

    def summary(name: str) -> tuple[float, float, float, int, float]:
        rounds = results[name]
        steps = [s for r in rounds for s in r["steps"]]
        return (
            statistics.median(r["tokens_per_s"] for r in rounds),
            percentile(steps, 0.5) * 1e3,
            percentile(steps, 0.99) * 1e3,
            len(steps),
            sum(r["hook_s"] for r in rounds) / max(len(steps), 1) * 1e6,
        )

    v, p, ps = summary("vanilla"), summary("plugin"), summary("plugin-steps")
    print(
        f"vllm_overhead: tiny Llama hidden {args.hidden} x {args.layers} layers, {args.requests} requests x "
        f"{args.max_tokens} output tokens, budget {args.budget}, {args.rounds} rounds each, alternated"
    )
    print(
        f"  {'engine':12} {'out tok/s':>10} {'step p50 ms':>12} {'step p99 ms':>12} {'steps':>7}"
        f" {'hook us/step':>13}"
    )
    for name, s in (("vanilla", v), ("plugin", p), ("plugin-steps", ps)):
        print(f"  {name:12} {s[0]:10.1f} {s[1]:12.2f} {s[2]:12.2f} {s[3]:7d} {s[4]:13.1f}")
    for name, s in (("plugin", p), ("plugin-steps", ps)):
        print(f"  {name}: throughput ratio (/ vanilla) {s[0] / v[0]:.3f} (goal >= 0.99), p99 step time ratio")
        print(
            f"    {s[2] / v[2]:.3f}, hook cost on the engine thread {s[4]:.1f} us per step = "
            f"{s[4] / 1e3 / s[1]:.2%} of the p50 step"
        )


if __name__ == "__main__":
    main()
