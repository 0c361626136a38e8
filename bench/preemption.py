"""Preemption under KV pressure: vLLM's FCFS victim choice against the plugin's escape valve.

The scene (fixed by ``--seed``): ``--requests`` requests arrive in a burst over ``--arrive-s`` seconds,
prompts of 200-400 tokens, output lengths drawn from a typical mix (``--short-out`` MIN,MAX tokens) with
one in ``--long-every`` a long one (``--long-out`` tokens, a runaway that its client capped), all with
``ignore_eos``; the KV cache (``--kv-tokens``) holds a fraction of the work, and
``scheduler_reserve_full_isl`` is off, so vLLM preempts. Each configuration runs in its own engine
process (in-process vLLM, driven step by step, the same arrival schedule):

* fcfs: vLLM's own choice (the last running request), the plugin only observing;
* escape-finish: ``preempt_escape_after=N``, protected until it finishes;
* escape-predicted: ``preempt_escape_after=N``, ``preempt_escape_for="predicted"``: protected for its
  predicted remaining output (conditional p90 of the lengths this engine has finished), then
  preemptible again.

Printed per configuration: preemptions (total, most of one request, by short and long requests),
prefill tokens recomputed after preemptions, escape-valve grants and lapses, latency p50/p99 of the
short requests (TTFT, end to end), the long requests' end-to-end p50/max, wall time and output tokens/s.

    .venv/bin/python -m bench.preemption
    .venv/bin/python -m bench.preemption --requests 48 --kv-tokens 6144 --escape-after 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.toolkit import in_process_vllm, percentile

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = ("fcfs", "escape-finish", "escape-predicted")


def scene(args: argparse.Namespace) -> list[tuple[float, str, int, int]]:
    """(arrival s, kind, prompt tokens, output tokens), sorted; the same for every configuration."""
    rng = random.Random(args.seed)
    low, high = args.short_out
    out = []
    for i in range(args.requests):
        t = rng.uniform(0.0, args.arrive_s)
        long = args.long_every > 0 and i % args.long_every == args.long_every - 1
        n_out = args.long_out if long else rng.randint(low, high)
        out.append((t, "long" if long else "short", rng.randint(200, 400), n_out))
    return sorted(out)


def worker(args: argparse.Namespace) -> None:
    settings = in_process_vllm(args.workdir)  # fp32 without native bf16, one OpenMP thread fewer
    os.environ.pop("CHUNKLEDGER_URL", None)
    from vllm import LLM, RequestOutput, SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_hooks.vllm.scheduler import external_request_id, iter_schedulers

    plugin: dict[str, Any] = {}
    if args.config != "fcfs":
        plugin["preempt_escape_after"] = args.escape_after
        plugin["preempt_escape_for"] = "predicted" if args.config == "escape-predicted" else "finish"
    llm = LLM(
        args.model,
        **settings.llm_kwargs(),
        enforce_eager=True,
        kv_cache_memory_bytes=args.kv_tokens * settings.kv_bytes_per_token(args.layers, args.hidden),
        max_num_batched_tokens=args.budget,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        max_model_len=2048,
        max_num_seqs=args.max_seqs,
        scheduler_reserve_full_isl=False,
        scheduler_cls="engine_hooks.vllm.LedgerScheduler",
        additional_config={"chunkledger": plugin},
    )
    engine = llm.llm_engine
    sch = next(iter(iter_schedulers(llm)))
    rng = random.Random(args.seed + 1)
    arrivals = scene(args)
    kinds: dict[str, str] = {}
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    out_tokens = 0
    seen: dict[str, tuple[int, int]] = {}  # request id -> (preemptions, computed tokens) before a step
    preemptions: dict[str, int] = {}
    recomputed = 0
    start = time.monotonic()
    i = steps = 0
    while i < len(arrivals) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while i < len(arrivals) and arrivals[i][0] <= now:
            _, kind, n_prompt, n_out = arrivals[i]
            rid = f"{kind}-{i}"
            params = SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0)
            tokens = [rng.randrange(10, 1300) for _ in range(n_prompt)]
            engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), params)
            kinds[rid], arrived[rid] = kind, now
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[i][0] - (time.monotonic() - start)))
            continue
        for req in (*sch.running, *sch.waiting):
            seen[req.request_id] = (req.num_preemptions, req.num_computed_tokens)
        outs = [o for o in engine.step() if isinstance(o, RequestOutput)]
        steps += 1
        for req in (*sch.running, *sch.waiting):
            before = seen.get(req.request_id)
            if before is not None and req.num_preemptions > before[0]:
                recomputed += before[1]  # what it had computed is lost (no prefix caching)
                preemptions[external_request_id(req)] = req.num_preemptions
        t = time.monotonic() - start
        for out in outs:
            rid = out.request_id
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n and rid not in first:
                first[rid] = t
            if out.finished:
                done[rid] = t
                out_tokens += n
    wall = time.monotonic() - start
    short = [r for r in kinds if kinds[r] == "short"]
    long = [r for r in kinds if kinds[r] == "long"]
    by_id = {r: preemptions.get(r, 0) for r in kinds}
    result = {
        "config": args.config,
        "requests": len(kinds),
        "finished": len(done),
        "preemptions": sum(by_id.values()),
        "preempt_max": max(by_id.values(), default=0),
        "preempt_short": sum(by_id[r] for r in short),
        "preempt_long": sum(by_id[r] for r in long),
        "recomputed": recomputed,
        "grants": len(sch.escape_grants),
        "lapses": sch.escape_lapses,
        "ttft_p50": percentile([first[r] - arrived[r] for r in short if r in first], 0.5),
        "ttft_p99": percentile([first[r] - arrived[r] for r in short if r in first], 0.99),
        "e2e_p50": percentile([done[r] - arrived[r] for r in short if r in done], 0.5),
        "e2e_p99": percentile([done[r] - arrived[r] for r in short if r in done], 0.99),
        "long_e2e_p50": percentile([done[r] - arrived[r] for r in long if r in done], 0.5),
        "long_e2e_max": max((done[r] - arrived[r] for r in long if r in done), default=float("nan")),
        "wall_s": wall,
        "tok_s": out_tokens / wall if wall > 0 else 0.0,
        "steps": steps,
        "hook_errors": sch.hook_errors,
    }
    print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--arrive-s", type=float, default=2.0, help="arrivals spread over this window (s)")
    parser.add_argument("--short-out", default="16,96", help="MIN,MAX output tokens of the typical ones")
    parser.add_argument("--long-every", type=int, default=8, help="one request in this many is long")
    parser.add_argument("--long-out", type=int, default=600, help="output tokens of the long ones")
    parser.add_argument("--kv-tokens", type=int, default=4096, help="KV cache size in tokens")
    parser.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument("--escape-after", type=int, default=2, help="preempt_escape_after of escape-*")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated configurations: " + ", ".join(CONFIGS))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        low, high = (int(x) for x in args.short_out.split(","))
    except ValueError:
        raise SystemExit(f"--short-out: expected MIN,MAX tokens, got {args.short_out!r}") from None
    if not 1 <= low <= high:
        raise SystemExit(f"--short-out: need 1 <= MIN <= MAX, got {args.short_out!r}")
    args.short_out = (low, high)
    if args.worker:
        worker(args)
        return
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--only: unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")

    from engine_hooks.vllm.tiny_model import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="chunkledger-preempt-"))
    model = build_tiny_model(tmp / "model", hidden=args.hidden, layers=args.layers, heads=4, max_pos=4096)
    results = []
    for name in names:
        cmd = [sys.executable, __file__, "--worker", "--config", name, "--model", model]
        cmd += ["--workdir", str(tmp / name), "--seed", str(args.seed), "--requests", str(args.requests)]
        cmd += ["--arrive-s", str(args.arrive_s), "--short-out", f"{low},{high}"]
        cmd += ["--long-every", str(args.long_every), "--long-out", str(args.long_out)]
        cmd += ["--kv-tokens", str(args.kv_tokens), "--budget", str(args.budget)]
        cmd += ["--max-seqs", str(args.max_seqs), "--escape-after", str(args.escape_after)]
        cmd += ["--hidden", str(args.hidden), "--layers", str(args.layers)]
        with open(tmp / f"{name}.log", "w") as log:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            print(f"{name}: failed (exit {proc.returncode}); see {tmp / (name + '.log')}", flush=True)
            continue
        results.append(json.loads(lines[-1]))
        print(f"  done: {name}", file=sys.stderr, flush=True)

    n_long = sum(1 for a in scene(args) if a[1] == "long")
    print(
        f"preemption: tiny Llama hidden {args.hidden} x {args.layers} layers (CPU); {args.requests} requests "
        f"over {args.arrive_s:g} s, prompts 200-400, outputs {low}-{high} ({n_long} long: {args.long_out}); "
        f"KV {args.kv_tokens} tokens, budget {args.budget}, max_num_seqs {args.max_seqs}; "
        f"escape after {args.escape_after}; seed {args.seed}"
    )
    head = (
        f"  {'config':17} {'preempt':>7} {'max/req':>7} {'short':>5} {'long':>4} {'recomputed':>10} "
        f"{'grants':>6} {'lapses':>6} | {'TTFT p50':>8} {'p99':>6} {'e2e p50':>7} {'p99':>6} | "
        f"{'long e2e p50':>12} {'max':>6} | {'wall s':>6} {'tok/s':>6}"
    )
    print(head)
    print("  " + "-" * (len(head) - 2))
    ms = 1e3
    for r in results:
        print(
            f"  {r['config']:17} {r['preemptions']:7d} {r['preempt_max']:7d} {r['preempt_short']:5d} "
            f"{r['preempt_long']:4d} {r['recomputed']:10d} {r['grants']:6d} {r['lapses']:6d} | "
            f"{r['ttft_p50'] * ms:8.0f} {r['ttft_p99'] * ms:6.0f} {r['e2e_p50'] * ms:7.0f} "
            f"{r['e2e_p99'] * ms:6.0f} | {r['long_e2e_p50'] * ms:12.0f} {r['long_e2e_max'] * ms:6.0f} | "
            f"{r['wall_s']:6.1f} {r['tok_s']:6.0f}"
        )
        if r["finished"] != r["requests"] or r["hook_errors"]:
            print(f"    ({r['finished']}/{r['requests']} finished, {r['hook_errors']} hook errors)")
    print("  (ms; short = the typical requests, long = the long-output ones)")


if __name__ == "__main__":
    main()
