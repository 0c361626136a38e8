"""Head-of-line blocking by one long prompt, under vLLM's chunking options and the plugin's reserve.

The scene (fixed by ``--seed``): short requests (32-64 prompt tokens, ``--short-output`` output tokens)
arrive at uniform random gaps for ``--duration`` seconds; one long prompt arrives at ``--long-at``
seconds. Unless ``--gap-ms`` and ``--long-tokens`` are given, the scene is sized for the engine first
(:mod:`ledger.advice.scene`, from a 30-second ``chunkledger profile`` plan): the shorts' rate keeps the
engine at most half busy even if each were served alone, and the long prompt is the shortest whose
prefill takes at least ``--long-prefill-s`` (3 s). The engine (tiny random-weight Llama on CPU, vLLM
in-process, with :func:`engine_hooks.vllm.cpu.engine_settings`: fp32 without native bf16, one OpenMP
thread on 2 cores) is driven step by step by this script, which adds each request when its arrival
time has come; a request's TTFT counts from that arrival time (one due during a step waits for the
step, as a client would). Each configuration runs in its own engine process with ``LedgerScheduler``
reporting to a real ledger (``chunkledger serve``, DuckDB), so the ledger's own view of the same run
is printed beside the client-side figures. The default table:

* no-long: the shorts alone (the baseline for short-request TTFT), budget 2048;
* unchunked: chunked prefill off (the long prompt is one step);
* chunk-N (256, 512, 2048): vLLM chunked prefill with ``max_num_batched_tokens`` N;
* chunk-2048-thr256: plus vLLM's ``long_prefill_token_threshold=256``;
* reserve: the plugin's admission reserve (up to a quarter of the budget, as much as the waiting
  requests and running decodes can take in the step, shortest prompt first);
* reserve-step-100, -50, -40, -30: the reserve plus ``admission_step_target_s`` 0.1 ... 0.03 s with
  ``admission_min_chunk=16`` (every step capped so that its duration, predicted from the engine's
  measured steps, stays within the target).

With ``--only``: reserve-depth (-1024, -512: the depth cap ``admission_depth_tokens``), reserve-step-75,
-150, -250, -400.

After the table: the baseline (its TTFT p99 in step times, the engine's busy share), each
configuration's short TTFT p99 over baseline and long TTFT over unchunked, the best plugin setting and
whether any vLLM knob matches or beats it on both axes, the goal (3x / 1.2x); no ratios when the
baseline is overloaded (short TTFT p99 above 10 step times: a growing queue). Then the lower bound of
:mod:`bench.hol_bound`: the least long-request TTFT that any chunking can reach while every step the
long prompt is in stays short enough for the short-TTFT goal. ``--json PATH`` also writes the results
(with every step's tokens, attention work, deepest chunk and duration), which ``bench/hol_bound.py
PATH`` reads again. ``--ledger-db PATH`` keeps the ledger's DuckDB file (each configuration's engine
is the source ``<tag>-<configuration>``, its ``source_id`` in the results), which ``bench/whatif_vllm.py``
reads.

Run it on an idle machine (the 1-minute load average at the end of each configuration is printed):
with other CPU-bound processes on the two cores the steps slow down and the figures mean little.

    .venv/bin/python -m bench.head_of_line --json /tmp/hol.json          # the seed's table, sized
    .venv/bin/python -m bench.head_of_line --long-tokens 16000 --gap-ms 20,50 --only no-long,chunk-256,reserve
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

from bench.toolkit import free_port, in_process_vllm, percentile

ROOT = Path(__file__).resolve().parent.parent

CONFIGS: dict[str, dict[str, Any]] = {
    "no-long": {"budget": 2048, "long": False},
    "unchunked": {"budget": 0, "chunked": False},
    "chunk-256": {"budget": 256},
    "chunk-512": {"budget": 512},
    "chunk-2048": {"budget": 2048},
    "chunk-2048-thr256": {"budget": 2048, "threshold": 256},
    "reserve": {"budget": 2048, "plugin": {"admission_reserve": 0.25}},
    "reserve-depth": {"budget": 2048, "plugin": {"admission_reserve": 0.25, "admission_depth_tokens": 4096}},
    "reserve-depth-1024": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_depth_tokens": 1024},
    },
    "reserve-depth-512": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_depth_tokens": 512},
    },
    "reserve-step-150": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_step_target_s": 0.15},
    },
    "reserve-step-250": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_step_target_s": 0.25},
    },
    "reserve-step-400": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_step_target_s": 0.4},
    },
    "reserve-step-50": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_step_target_s": 0.05, "admission_min_chunk": 16},
    },
    "reserve-step-100": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_step_target_s": 0.1, "admission_min_chunk": 16},
    },
    "reserve-step-75": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_step_target_s": 0.075, "admission_min_chunk": 16},
    },
    "reserve-step-40": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_step_target_s": 0.04, "admission_min_chunk": 16},
    },
    "first-step-100": {
        "budget": 2048,
        "plugin": {
            "admission_reserve": 0.25,
            "admission_step_target_s": 0.1,
            "admission_min_chunk": 16,
            "admission_arrivals_first": True,
        },
    },
    "first-step-75": {
        "budget": 2048,
        "plugin": {
            "admission_reserve": 0.25,
            "admission_step_target_s": 0.075,
            "admission_min_chunk": 16,
            "admission_arrivals_first": True,
        },
    },
    "first-step-50": {
        "budget": 2048,
        "plugin": {
            "admission_reserve": 0.25,
            "admission_step_target_s": 0.05,
            "admission_min_chunk": 16,
            "admission_arrivals_first": True,
        },
    },
    "reserve-step-30": {
        "budget": 2048,
        "plugin": {"admission_reserve": 0.25, "admission_step_target_s": 0.03, "admission_min_chunk": 16},
    },
}


# The seed's table: no long prompt, no chunking, vLLM's budgets, budget + threshold, the plugin's reserve
# variants (the rest run with --only).
DEFAULT_CONFIGS = (
    "no-long",
    "unchunked",
    "chunk-256",
    "chunk-512",
    "chunk-2048",
    "chunk-2048-thr256",
    "reserve",
    "reserve-step-100",
    "reserve-step-50",
    "reserve-step-40",
    "reserve-step-30",
)
VLLM_KNOBS = ("unchunked", "chunk-")  # name prefixes of the configurations that use vLLM's knobs only
SHORT_PROMPT = (32, 64)
MAX_LONG_TOKENS = 32000


def scene(args: argparse.Namespace) -> list[tuple[float, str, int, int]]:
    """(arrival s, kind, prompt tokens, output tokens), sorted; the same for every configuration."""
    rng = random.Random(args.seed)
    out = []
    t = 0.0
    while t < args.duration:
        t += rng.uniform(args.gap_min_s, args.gap_max_s)
        out.append((t, "short", rng.randint(*SHORT_PROMPT), args.short_output))
    out.append((args.long_at, "long", args.long_tokens, 4))
    return sorted(out)


# -- worker: one configuration in one engine ---------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    settings = in_process_vllm(args.workdir)  # fp32 without native bf16, one OpenMP thread fewer
    from vllm import LLM, RequestOutput, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = CONFIGS[args.config]
    max_len = args.long_tokens + 256
    chunked = cfg.get("chunked", True)
    llm = LLM(
        args.model,
        **settings.llm_kwargs(),
        enforce_eager=True,
        kv_cache_memory_bytes=args.kv_mib << 20,
        max_num_batched_tokens=cfg["budget"] if chunked else max_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=cfg.get("threshold", 0),
        max_model_len=max_len,
        max_num_seqs=128,
        enable_prefix_caching=False,
        scheduler_cls="engine_hooks.vllm.LedgerScheduler",
        additional_config={"chunkledger": cfg.get("plugin", {})},
    )
    engine = llm.llm_engine
    rng = random.Random(args.seed + 1)
    warm = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request(
        "warmup", TokensPrompt(prompt_token_ids=[rng.randrange(10, 1300) for _ in range(64)]), warm
    )
    while engine.has_unfinished_requests():
        engine.step()
    # Each step's shape, read from the plugin's own record of what it scheduled (update_from_output
    # runs inside engine.step): prefill tokens, decode tokens, attention work, deepest prefill chunk.
    shapes: list[tuple[int, int, float, int]] = []
    for sched in _schedulers(llm):
        update = sched.update_from_output

        def peek(scheduler_output: Any, runner_output: Any, _s: Any = sched, _update: Any = update) -> Any:
            info = _s._cl_steps.get(id(scheduler_output))
            if info:
                shapes.append((info[3], info[4], info[15], info[12]))
            return _update(scheduler_output, runner_output)

        sched.update_from_output = peek
    records: list[list[float]] = []  # per step: prefill tokens, decode tokens, work, deepest chunk, s
    arrivals = [a for a in scene(args) if cfg.get("long", True) or a[1] != "long"]
    prefix = f"{args.tag}-{args.config}"
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    gaps: list[tuple[float, float]] = []  # (end time, gap) of each short's inter-token gap
    steps: list[float] = []
    step_ends: list[float] = []
    scene_ts = time.time()  # wall clock: the ledger's window of the scene (the warmup is before it)
    start = time.monotonic()
    i = 0
    while i < len(arrivals) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while i < len(arrivals) and arrivals[i][0] <= now:
            _, kind, n_prompt, n_out = arrivals[i]
            rid = f"{prefix}-long" if kind == "long" else f"{prefix}-s{i}"
            params = SamplingParams(
                max_tokens=n_out, ignore_eos=True, temperature=0.0, extra_args={"chunkledger_request_id": rid}
            )
            tokens = [rng.randrange(10, 1300) for _ in range(n_prompt)]
            # --stamp-arrival: vLLM's arrival_time (the ledger's engine_arrival_ts) is the scene's, as an
            # API server stamps a request it receives during a step; else the time it is added here.
            stamp = scene_ts + arrivals[i][0] if args.stamp_arrival else None
            engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), params, arrival_time=stamp)
            # TTFT counts from the arrival the scene gave it, as a client's would: a request due
            # during a step cannot be added before the step ends, and that wait is part of its TTFT.
            arrived[rid] = arrivals[i][0]
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[i][0] - (time.monotonic() - start)))
            continue
        shapes.clear()
        t0 = time.monotonic()
        outs = [o for o in engine.step() if isinstance(o, RequestOutput)]
        t1 = time.monotonic()
        steps.append(t1 - t0)
        if len(shapes) == 1:
            records.append([*shapes[0], round(t1 - t0, 6)])
        t = t1 - start
        step_ends.append(t)
        for out in outs:
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            rid = out.request_id
            if not n:
                continue
            if rid not in first:
                first[rid] = t
            prev = last.get(rid)
            if prev is not None and n > prev[1] and not rid.endswith("-long"):
                gaps.append((t, t - prev[0]))
            if prev is None or n > prev[1]:
                last[rid] = (t, n)
    long_id = f"{prefix}-long"
    long_start = arrived.get(long_id)
    long_end = first.get(long_id)
    shorts = [r for r in arrived if r != long_id]
    ttft = [first[r] - arrived[r] for r in shorts if r in first]
    window = [
        g
        for end, g in gaps
        if long_start is not None and long_end is not None and long_start <= end <= long_end
    ]
    during = [
        d
        for d, end in zip(steps, step_ends, strict=True)
        if long_start is not None and long_end is not None and long_start < end <= long_end
    ]
    result = {
        "config": args.config,
        "long_steps": len(during),
        "long_step_ms": 1e3 * sum(during) / len(during) if during else float("nan"),
        "shorts": len(shorts),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "ttft_max": max(ttft) if ttft else float("nan"),
        "itl_p99": percentile(window or [g for _, g in gaps], 0.99),
        "itl_max": max(window or [g for _, g in gaps] or [float("nan")]),
        "long_ttft": (long_end - long_start) if long_start is not None and long_end is not None else None,
        "busy": sum(steps) / max(time.monotonic() - start, 1e-9),
        "step_p50": percentile(steps, 0.5),
        "step_p99": percentile(steps, 0.99),
        "hook_errors": sum(getattr(s, "hook_errors", 0) for s in _schedulers(llm)),
        "step_caps": sum(len(getattr(s, "step_caps", ())) for s in _schedulers(llm)),
        "step_fit": next((s.step_times.coefficients() for s in _schedulers(llm) if s.step_caps), None),
        "step_records": records,
        "load": os.getloadavg()[0],
        "scene_ts": scene_ts,
        "engine": _engine_as_run(llm),
    }
    for s in _schedulers(llm):
        if s.exporter is not None:
            s.exporter.force_flush(30.0)
    print(json.dumps(result), flush=True)


def size_worker(args: argparse.Namespace) -> None:
    """Profile the engine (a small plan of ledger.advice.profile) and print the scene's size as JSON."""
    from engine_hooks.vllm.tiny_model import vllm_env

    os.environ.update(vllm_env(args.workdir))
    os.environ.pop("CHUNKLEDGER_URL", None)
    import logging

    logging.disable(logging.WARNING)
    from engine_hooks.vllm.profile import run_profile
    from ledger.advice.profile import ProfileResult
    from ledger.advice.scene import SIZING_PLAN, size_from_profile
    from ledger.records import as_json

    t0 = time.monotonic()
    run = run_profile(args.model, SIZING_PLAN, kv_cache_bytes=args.kv_mib << 20)
    sized = size_from_profile(
        ProfileResult.of(SIZING_PLAN, run),
        short_prompt=sum(SHORT_PROMPT) // 2,
        short_output=args.short_output,
        long_prefill_s=args.long_prefill_s,
        max_long_tokens=MAX_LONG_TOKENS,
    )
    out = {**as_json(sized), "seconds": time.monotonic() - t0}
    print(json.dumps(out), flush=True)


def _engine_as_run(llm: Any) -> dict[str, Any]:
    """The scheduler's settings as vLLM ran them (the KV cache it allocated, its block size), in the
    names of :class:`engine_hooks.scheduling.settings.EngineSettings`."""
    s = _schedulers(llm)[0]
    cfg = s.scheduler_config
    return {
        "max_num_batched_tokens": int(s.max_num_scheduled_tokens),
        "long_prefill_token_threshold": int(cfg.long_prefill_token_threshold),
        "enable_chunked_prefill": bool(cfg.enable_chunked_prefill),
        "max_num_seqs": int(s.max_num_running_reqs),
        "num_kv_blocks": int(s.kv_cache_config.num_blocks),
        "block_size": int(s.block_size),
        "reserve_full_isl": bool(s.scheduler_reserve_full_isl),
        "adaptive_threshold": bool(s.adaptive_long_prefill_threshold),
    }


def _schedulers(llm: Any) -> list[Any]:
    from engine_hooks.vllm.scheduler import iter_schedulers

    return list(iter_schedulers(llm))


# -- parent --------------------------------------------------------------------------------------


def _ledger_view(url: str, prefix: str) -> dict[str, Any]:
    import httpx

    sql = (
        "SELECT count(*) AS n, quantile_cont(ttft_s, 0.99) AS ttft_p99, "
        "quantile_cont(backend_wait_ttft_s, 0.99) AS wait_p99, "
        "sum(backend_wait_ttft_s) / nullif(sum(ttft_s), 0) AS wait_share "
        "FROM requests WHERE request_id LIKE $p AND ttft_s IS NOT NULL"
    )
    try:
        r = httpx.post(f"{url}/v1/sql", json={"sql": sql, "params": {"p": f"{prefix}-s%"}}, timeout=30)
        body = r.json()
        row = body["rows"][0]
        return dict(zip(body["columns"], row, strict=False))
    except Exception as exc:  # the ledger view is a bonus: print the bench figures anyway
        return {"error": f"{type(exc).__name__}: {exc}"}


def _parse_gaps(args: argparse.Namespace) -> None:
    try:
        low, high = (float(x) / 1e3 for x in args.gap_ms.split(","))
    except ValueError:
        raise SystemExit(f"--gap-ms: expected MIN,MAX in milliseconds, got {args.gap_ms!r}") from None
    if not 0 < low <= high:
        raise SystemExit(f"--gap-ms: need 0 < MIN <= MAX, got {args.gap_ms!r}")
    args.gap_min_s, args.gap_max_s = low, high


def _size(args: argparse.Namespace, model: str, tmp: Path) -> dict[str, Any]:
    """Run the sizing worker (profile + ledger.advice.scene) and print what it chose."""
    cmd = [sys.executable, __file__, "--worker", "--config", "size", "--model", model]
    cmd += [
        "--workdir",
        str(tmp / "size"),
        "--kv-mib",
        str(args.kv_mib),
        "--short-output",
        str(args.short_output),
    ]
    cmd += ["--long-prefill-s", str(args.long_prefill_s)]
    with open(tmp / "size.log", "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"sizing failed (exit {proc.returncode}); see {tmp / 'size.log'}")
    out = json.loads(lines[-1])
    import msgspec

    from ledger.advice.scene import SceneSize

    size = msgspec.convert(out["size"], SceneSize)
    print(f"{size.describe()}\n  (profile: {out['steps']} steps in {out['seconds']:.0f} s)", flush=True)
    return out["size"]


SHORT_GOAL = 3.0  # short TTFT p99 <= 3x the no-long baseline ...
LONG_GOAL = 1.2  # ... with the long TTFT <= 1.2x unchunked
OVERLOAD_STEPS = 10.0  # a baseline short TTFT p99 above this many step times is a growing queue


def is_vllm_knob(name: str) -> bool:
    return name.startswith(VLLM_KNOBS)


def ratios(results: list[dict[str, Any]]) -> dict[str, tuple[float, float | None]]:
    """(short TTFT p99 / baseline's, long TTFT / unchunked's or None) per configuration but no-long."""
    by = {r["config"]: r for r in results}
    base, unchunked = by.get("no-long"), by.get("unchunked")
    if base is None:
        return {}
    out = {}
    for r in results:
        if r["config"] == "no-long":
            continue
        long = None
        if unchunked is not None and r.get("long_ttft") and unchunked.get("long_ttft"):
            long = r["long_ttft"] / unchunked["long_ttft"]
        out[r["config"]] = (r["ttft_p99"] / base["ttft_p99"], long)
    return out


def summary(results: list[dict[str, Any]]) -> list[str]:
    """The ratio lines, the best plugin setting and whether any of vLLM's knobs matches or beats it on
    both axes, the goal; or why there are no ratios (no baseline, or an overloaded one)."""
    base = next((r for r in results if r["config"] == "no-long"), None)
    if base is None:
        return ["  no ratios: the no-long baseline did not run"]
    if base["ttft_p99"] > OVERLOAD_STEPS * base["step_p50"]:
        return [
            "  no ratios: the baseline is overloaded (no-long short TTFT p99 "
            f"{base['ttft_p99'] * 1e3:.0f} ms "
            f"> {OVERLOAD_STEPS:g} x its step p50 {base['step_p50'] * 1e3:.1f} ms): the figures measure "
            "a growing queue, not the long prompt; run on an idle machine or with fewer shorts (--gap-ms)"
        ]
    lines = [
        f"  baseline: short TTFT p99 {base['ttft_p99'] * 1e3:.1f} ms = "
        f"{base['ttft_p99'] / base['step_p50']:.1f} step times (p50 step {base['step_p50'] * 1e3:.1f} ms); "
        f"engine busy {base.get('busy', float('nan')):.0%} of the run"
    ]
    rs = ratios(results)
    for name, (short, long) in rs.items():
        line = f"  {name:19} short TTFT p99 = {short:6.1f}x baseline"
        if long is not None:
            line += f", long TTFT = {long:5.2f}x unchunked"
        lines.append(line)
    complete = {n: (a, b) for n, (a, b) in rs.items() if b is not None}
    knobs = {n: v for n, v in complete.items() if is_vllm_knob(n)}
    plugin = {n: v for n, v in complete.items() if not is_vllm_knob(n)}
    if plugin:

        def beaten_by(point: tuple[float, float]) -> list[str]:
            return [n for n, (a, b) in knobs.items() if a <= point[0] and b <= point[1]]

        free = {n: v for n, v in plugin.items() if not beaten_by(v)}
        pool = free or plugin
        best = min(pool, key=lambda n: max(pool[n][0] / SHORT_GOAL, pool[n][1] / LONG_GOAL))
        short, long = plugin[best]
        by = beaten_by(plugin[best])
        verdict = (
            f"matched or beaten on both axes by {', '.join(by)}"
            if by
            else f"no vLLM knob tried ({', '.join(knobs) or 'none'}) matches or beats it on both axes"
        )
        lines.append(f"  best plugin setting: {best} ({short:.1f}x, {long:.2f}x): {verdict}")
        goal = f"short TTFT p99 <= {SHORT_GOAL:g}x baseline with long TTFT <= {LONG_GOAL:g}x unchunked"
        met = [n for n, (a, b) in complete.items() if a <= SHORT_GOAL and b <= LONG_GOAL]
        if met:
            lines.append(f"  goal ({goal}): met by {', '.join(met)}")
        else:
            lines.append(f"  goal ({goal}): not met by any setting (the bound below: could any policy?)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--long-tokens", type=int, default=0, help="long prompt tokens; 0: sized from the engine's profile"
    )
    parser.add_argument("--long-at", type=float, default=2.0, help="arrival of the long prompt (s)")
    parser.add_argument(
        "--duration",
        type=float,
        default=0.0,
        help="arrivals window (s); 0: long-at + 1.5 x the predicted long prefill (at least 6 s)",
    )
    parser.add_argument("--short-output", type=int, default=16, help="output tokens of each short request")
    parser.add_argument(
        "--gap-ms", default="", help="min,max gap between short arrivals (ms); empty: sized (half busy)"
    )
    parser.add_argument(
        "--long-prefill-s",
        type=float,
        default=3.0,
        help="sizing: the long prompt's prefill takes at least this",
    )
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-mib", type=int, default=512, help="KV cache size (MiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated configurations: " + ", ".join(CONFIGS))
    parser.add_argument("--json", default="", help="also write the results (with every step) to this file")
    parser.add_argument(
        "--ledger-db", default="", help="the ledger's DuckDB file (kept); default: a temporary one"
    )
    parser.add_argument(
        "--stamp-arrival",
        action="store_true",
        help="give vLLM each request's scene arrival as its arrival_time (the ledger's engine arrival)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker and args.config == "size":
        size_worker(args)
        return
    if args.gap_ms:
        _parse_gaps(args)
    if args.worker:
        worker(args)
        return
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(DEFAULT_CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"--only: unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")

    from engine_hooks.vllm.cpu import engine_settings
    from engine_hooks.vllm.tiny_model import build_tiny_model

    print(engine_settings().describe(), flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="chunkledger-hol-"))
    model = build_tiny_model(
        tmp / "model",
        hidden=args.hidden,
        layers=args.layers,
        heads=4,
        max_pos=max(args.long_tokens, MAX_LONG_TOKENS) + 512,
    )
    sizing = None
    if not args.long_tokens or not args.gap_ms:
        sizing = _size(args, model, tmp)
        if not args.long_tokens:
            args.long_tokens = int(sizing["long_tokens"])
        if not args.gap_ms:
            args.gap_ms = ",".join(f"{g:g}" for g in sizing["gap_ms"])
            _parse_gaps(args)
    if not args.duration:
        predicted = sizing["predicted_long_prefill_s"] if sizing else 4.0
        args.duration = args.long_at + max(6.0, 1.5 * predicted)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ledger_log = open(tmp / "ledger.log", "wb")  # noqa: SIM115 - closed at the end
    ledger = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chunkledger",
            "serve",
            "--db",
            f"duckdb:///{Path(args.ledger_db).resolve() if args.ledger_db else tmp / 'ledger.duckdb'}",
            "--port",
            str(port),
        ],
        stdout=ledger_log,
        stderr=subprocess.STDOUT,
    )
    tag = f"hol{int(time.time())}"
    results = []
    try:
        for name in names:
            cmd = [sys.executable, __file__, "--worker", "--config", name, "--model", model, "--tag", tag]
            cmd += ["--workdir", str(tmp / name), "--seed", str(args.seed), "--kv-mib", str(args.kv_mib)]
            cmd += ["--long-tokens", str(args.long_tokens), "--long-at", str(args.long_at)]
            cmd += ["--duration", str(args.duration), "--short-output", str(args.short_output)]
            cmd += ["--gap-ms", args.gap_ms] + (["--stamp-arrival"] if args.stamp_arrival else [])
            env = {
                **os.environ,
                "CHUNKLEDGER_URL": url,
                "CHUNKLEDGER_SOURCE_ID": f"{tag}-{name}",
                "CHUNKLEDGER_SPOOL_DIR": str(tmp / "spool"),
            }
            with open(tmp / f"{name}.log", "w") as log:
                proc = subprocess.run(
                    cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, timeout=1800
                )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                print(f"{name}: failed (exit {proc.returncode}); see {tmp / (name + '.log')}", flush=True)
                continue
            result = json.loads(lines[-1])
            result["ledger"] = _ledger_view(url, f"{tag}-{name}")
            result["source_id"] = f"{tag}-{name}"  # the engine's source in the ledger
            results.append(result)
            print(f"  done: {name}", file=sys.stderr, flush=True)
    finally:
        ledger.terminate()
        ledger.wait(30)
        ledger_log.close()

    ms = 1e3
    print(
        f"head_of_line: tiny Llama hidden {args.hidden} x {args.layers} layers (CPU); shorts of "
        f"{SHORT_PROMPT[0]}-{SHORT_PROMPT[1]} tokens "
        f"every {args.gap_ms} ms for {args.duration:.0f} s, {args.short_output} output tokens; one "
        f"{args.long_tokens}-token prompt at t={args.long_at:g} s; seed {args.seed}"
    )
    head = (
        f"  {'config':19} {'shorts':>6} {'TTFT p50':>9} {'p99':>8} {'max':>8} {'ITL p99':>8} {'max':>8} "
        f"{'long TTFT':>10} {'steps':>5} {'mean':>6} {'step p50':>9} {'p99':>8} | "
        f"{'ledger TTFT p99':>15} {'backend wait':>12}"
    )
    print(head)
    print("  " + "-" * (len(head) - 2))
    for r in results:
        led = r["ledger"]
        long_ttft = f"{r['long_ttft'] * ms:10.0f}" if r["long_ttft"] is not None else f"{'-':>10}"
        if r["long_ttft"] is not None:
            long_ttft += f" {r['long_steps']:5d} {r['long_step_ms']:6.1f}"
        else:
            long_ttft += f" {'-':>5} {'-':>6}"
        ledger_p99 = led.get("ttft_p99")
        share = led.get("wait_share")
        print(
            f"  {r['config']:19} {r['shorts']:6d} {r['ttft_p50'] * ms:9.0f} {r['ttft_p99'] * ms:8.0f} "
            f"{r['ttft_max'] * ms:8.0f} {r['itl_p99'] * ms:8.0f} {r['itl_max'] * ms:8.0f} {long_ttft} "
            f"{r['step_p50'] * ms:9.1f} {r['step_p99'] * ms:8.1f} | "
            f"{(ledger_p99 or float('nan')) * ms:15.0f} {(share or float('nan')):12.0%}"
        )
    print(
        "  (ms; ITL: gaps of short requests decoding while the long prefill ran; steps, mean: the steps "
        "from the long prompt's arrival to its first token; ledger: requests view)"
    )
    for line in summary(results):
        print(line)
    for r in results:
        fit = r.get("step_fit")
        if fit:
            print(
                f"  {r['config']:19} {r['step_caps']} chunks capped by the step target; step time fit "
                f"{fit[0] * 1e3:.1f} ms + {fit[1] * 1e6:.1f} us/token + {fit[2] * 1e9:.1f} ns/attention work "
                f"+ {fit[3] * 1e9:.0f} ns/token of chunk depth"
            )
    loads = ", ".join(f"{r['config']} {r.get('load', float('nan')):.1f}" for r in results)
    print(f"  load average (1 min) at the end of each run, on {os.cpu_count()} cores: {loads}")
    scene_info = {
        "long_tokens": args.long_tokens,
        "hidden": args.hidden,
        "layers": args.layers,
        "gap_ms": [args.gap_min_s * 1e3, args.gap_max_s * 1e3],
        "short_prompt": list(SHORT_PROMPT),
        "sizing": sizing,
        "seed": args.seed,
    }
    if args.json:
        Path(args.json).write_text(json.dumps({"scene": scene_info, "results": results}))
    from bench.hol_bound import report

    print()
    print(report(scene_info, results))


if __name__ == "__main__":
    main()
