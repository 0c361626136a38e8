"""Speed of the what-if replay (:func:`ledger.whatif.model.replay`) on a synthetic fleet hour.

The scene (fixed by ``--seed``): ``--engines`` engines, each with ``--requests`` requests over
``--hour-s`` seconds (Poisson arrivals), prompts lognormal around 600 tokens clipped to 50..8000 with
one in ``--long-every`` a 20k-token one, outputs lognormal clipped to 1..1000, a third of the requests
with a cached prefix (a block-aligned share of the prompt). Each engine's trace is replayed under the
same settings (``--budget``, ``--max-seqs``, ``--kv-blocks``), with a step cost of 8 ms + 30 us per
prefill token + 60 us per decode + 2 ms x KV usage.

Printed per engine and in total: replay wall time, requests/s and steps/s replayed, steps, simulated
time, TTFT/ITL/end-to-end tails and preemptions; with ``--check``, also the wall time of the same
replay without fast-forward and whether the results are identical.

    .venv/bin/python -m bench.whatif
    .venv/bin/python -m bench.whatif --engines 1 --check
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from engine_hooks.scheduling.settings import EngineSettings
from ledger.whatif.model import replay
from ledger.whatif.noise import StepNoise
from ledger.whatif.types import StepShape, TraceRequest


def cost(s: StepShape) -> float:
    return 0.008 + 30e-6 * s.prefill_tokens + 60e-6 * s.num_decode_reqs + 0.002 * s.kv_usage


def trace(rng: np.random.Generator, n: int, hour_s: float, long_every: int, block: int) -> list[TraceRequest]:
    arrivals = np.cumsum(rng.exponential(hour_s / n, n))
    prompts = np.clip(rng.lognormal(np.log(600), 1.0, n), 50, 8000).astype(np.int64)
    if long_every:
        prompts[rng.random(n) < 1.0 / long_every] = 20_000
    outputs = np.clip(rng.lognormal(np.log(150), 1.0, n), 1, 1000).astype(np.int64)
    share = np.where(rng.random(n) < 1 / 3, rng.random(n), 0.0)
    cached = (prompts * share).astype(np.int64) // block * block
    cached = np.minimum(cached, (prompts - 1) // block * block)
    return [
        TraceRequest(f"r{i}", float(arrivals[i]), int(prompts[i]), int(cached[i]), int(outputs[i]))
        for i in range(n)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--requests", type=int, default=12_500, help="requests per engine")
    ap.add_argument("--hour-s", type=float, default=3600.0)
    ap.add_argument("--long-every", type=int, default=500)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--kv-blocks", type=int, default=8192)
    ap.add_argument("--policy", default="fcfs")
    ap.add_argument("--reserve", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check", action="store_true", help="also replay without fast-forward and compare")
    ap.add_argument(
        "--no-step-noise",
        dest="step_noise",
        action="store_false",
        help="replay fitted times alone (what-if multiplies decode-only steps by the window's spread)",
    )
    args = ap.parse_args()
    settings = EngineSettings(
        max_num_batched_tokens=args.budget,
        max_num_seqs=args.max_seqs,
        num_kv_blocks=args.kv_blocks,
        policy=args.policy,
        admission_reserve=args.reserve,
    )
    rng = np.random.default_rng(args.seed)
    traces = [
        trace(rng, args.requests, args.hour_s, args.long_every, settings.block_size)
        for _ in range(args.engines)
    ]
    # as what_if() does by default: decode-only steps times a factor from a window's spread (log-normal
    # here, sigma 0.2, a CPU's decode steps)
    noise = StepNoise(np.exp(rng.normal(0.0, 0.2, 4000)), seed=args.seed) if args.step_noise else None
    total_wall = 0.0
    total_steps = total_reqs = 0
    for k, reqs in enumerate(traces):
        t0 = time.perf_counter()
        out = replay(reqs, settings, cost, noise=noise)
        wall = time.perf_counter() - t0
        total_wall += wall
        total_steps += out.steps
        total_reqs += len(reqs)
        s = out.summary(long_prompt_tokens=20_000)
        print(
            f"engine {k}: {wall:.2f} s wall, {len(reqs) / wall:,.0f} requests/s, "
            f"{out.steps / wall:,.0f} steps/s; "
            f"{out.steps:,} steps over {out.simulated_s:,.0f} s simulated; TTFT p50 {s['ttft_p50_s']:.3f} s "
            f"p99 {s['ttft_p99_s']:.3f} s (short p99 {s['short_ttft_p99_s']:.3f} s, long max "
            f"{s['long_ttft_max_s'] or 0:.3f} s), ITL p99 {s['itl_p99_s']:.4f} s, e2e p99 "
            f"{s['e2e_p99_s']:.2f} s, {s['preemptions']} preemptions"
        )
        if args.check:
            t0 = time.perf_counter()
            plain = replay(reqs, settings, cost, noise=noise, fast_forward=False)
            plain_wall = time.perf_counter() - t0
            same = (
                np.array_equal(plain.ttft_s, out.ttft_s)
                and np.array_equal(plain.e2e_s, out.e2e_s)
                and np.array_equal(plain.preemptions, out.preemptions)
                and plain.steps == out.steps
            )
            print(f"  without fast-forward: {plain_wall:.2f} s wall; identical results: {same}")
    print(
        f"total: {total_reqs:,} requests, {total_steps:,} steps in {total_wall:.2f} s: "
        f"{total_reqs / total_wall:,.0f} requests/s, {total_steps / total_wall:,.0f} steps/s"
    )


if __name__ == "__main__":
    main()
