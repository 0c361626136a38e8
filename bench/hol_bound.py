"""Lower bound on the long request's TTFT under issue 4's short-TTFT goal, from measured steps.

Issue 4's goal on the head-of-line scene (``bench/head_of_line.py``): short-request TTFT p99 <= 3x the
no-long-prompt baseline while the long request's TTFT stays <= 1.2x its unchunked TTFT. This module
computes, from the engine's own measured steps, the least long TTFT that ANY policy scheduling the long
prefill in engine steps (chunked in any way, interleaved with the shorts in any way) can reach while
meeting the short goal, and divides it by the measured unchunked long TTFT. Above 1.2, no scheduling
policy meets both goals on the hardware measured.

The step-time model is the plugin's own (:class:`engine_hooks.vllm.predict.StepTimes`), fitted without
decay to every measured step of the run's configurations (the unchunked configuration's steps left out
by default: its one 16k-token step would dominate a least-squares fit of the short steps that matter)::

    step(s) = a + b * tokens + c * work,   work = n * (depth + n / 2) per prefill chunk of n tokens

The derivation:

1. A short that arrives ``u`` seconds into a step of duration ``S`` cannot join that step; its first
   token comes no earlier than ``(S - u) + s_own``, where ``s_own`` is the cheapest step that can carry
   its prefill (``a + b n + c n^2 / 2`` with n = 32, the smallest short prompt, alone in the step). So
   with ``G = 3 x baseline p99``, every short arriving within the first ``S - S_max`` seconds of a step
   misses the goal, ``S_max = G - s_own``.
2. The p99 of N shorts is the ``int(0.99 N)``-th smallest, so ``m = N - 1 - int(0.99 N)`` shorts may
   miss. Steps may therefore run over ``S_max`` by a total of ``E``; ``E = (m + 1) x the longest arrival
   gap`` is granted (generous: that much exposed time catches at least m + 1 arrivals only in the worst
   case; on average it catches (m + 1) x longest / mean gap).
3. The long prompt's L tokens cost ``W = b L + c L^2 / 2`` of per-token and attention work however they
   are chunked (the chunks' ``n (depth + n / 2)`` sum to ``L^2 / 2``), plus ``a`` per step that carries a
   chunk. Each such step is at most ``S_max`` (plus the slack), so at least
   ``K = ceil((W - E) / (S_max - a))`` steps carry it, and its TTFT is at least ``K a + W`` (the
   shorts' own work, which can only add to it, counted as free). Every step must carry a token, so
   ``a + b + c L <= S_max`` too, or no policy exists at all.
4. The bound is divided by the measured unchunked long TTFT ``U``; a second figure takes the long
   prompt's work as measured, ``W = U - a`` (the unchunked run is one step of it, plus a wait), so a fit
   that misjudges the 16k-token step does not decide the answer: the smaller ratio is the bound.

5. With the plugin's per-chunk depth term (``+ e depth``: what a chunk pays to read its prefix's KV
   whatever its size, fitted to the same steps) the chunking's cost beyond the fixed work is
   ``a + e depth`` per chunk, which the greedy chunking (the largest chunk within ``S_max`` at every
   depth) minimises; its long TTFT, with the p99's slack spent on the one step where it saves most and
   the lesser of the fit's and the measured prefill work, is the second bound. When it is above 1.2x
   while the first is not, the engine's per-chunk cost is what rules the goal out.

Roughly, the bound is ``1 + a / (S_max - a)`` (times W / U): the goals can meet only where the step's
fixed cost is at most about a sixth of the longest step the shorts tolerate.

    .venv/bin/python -m bench.hol_bound /tmp/hol.json      # a file written by head_of_line.py --json
    .venv/bin/python -m bench.hol_bound --constants 7.7,10,25.6,15,4320 --sweep-a   # figures given
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from engine_hooks.vllm.predict import StepTimes, attention_work  # does not import vLLM

ROOT = Path(__file__).resolve().parent.parent

SHORT_FACTOR = 3.0  # issue 4: short TTFT p99 <= 3x baseline
LONG_FACTOR = 1.2  # ... with the long TTFT <= 1.2x unchunked
SHORT_PROMPT_MIN = 32


def fit(
    results: list[dict[str, Any]], exclude: tuple[str, ...] = ("unchunked",)
) -> tuple[float, float, float]:
    """(a s, b s/token, c s/work): the non-negative least-squares fit of the steps' measured durations."""
    given = next((r["coef"] for r in results if r.get("coef")), None)
    if given is not None:
        return tuple(given)  # type: ignore[return-value]
    times = StepTimes(decay=1.0, min_samples=1)
    for r in results:
        if r["config"] in exclude:
            continue
        for prefill, decode, work, _deepest, seconds in r.get("step_records", ()):
            times.add(int(prefill + decode), float(work), float(seconds))
    coef = times.coefficients()  # fed without chunk depths: its fourth term stays 0
    if coef is None:
        raise SystemExit("hol_bound: no steps to fit (run head_of_line.py with --json, this version)")
    return coef[:3]


def fit_with_depth(
    results: list[dict[str, Any]], exclude: tuple[str, ...] = ("unchunked",)
) -> tuple[float, float, float, float] | None:
    """(a, b, c, e): the same fit with the plugin's per-chunk depth term (e s per token of the deepest
    chunk's start, what a chunk pays to read its prefix's KV whatever its size); None without steps."""
    times = StepTimes(decay=1.0, min_samples=1)
    for r in results:
        if r["config"] in exclude:
            continue
        for prefill, decode, work, deepest, seconds in r.get("step_records", ()):
            times.add(int(prefill + decode), float(work), float(seconds), int(deepest) if prefill else 0)
    return times.coefficients()


def greedy_cost(
    coef: tuple[float, float, float, float],
    long_tokens: int,
    s_max: float,
    boost_at: int | None = None,
    boost: float = 0.0,
) -> tuple[int, float] | None:
    """(steps, seconds) of prefilling the long prompt alone in the largest chunk within ``s_max`` at
    each depth, under ``a + b n + c n (depth + n / 2) + e depth``; None when a step cannot carry a token.
    ``boost_at``: the step (0-based) that may run ``boost`` s longer (the p99's slack spent at once).

    Under this model the greedy chunking is the fastest within ``s_max``: the attention work of all
    chunks sums to ``L^2 / 2`` whatever the chunking, so a chunking's cost beyond that is
    ``a + e depth`` per chunk, and the greedy one has the fewest chunks starting past every depth."""
    a, b, c, e = coef
    depth = steps = 0
    total = 0.0
    while depth < long_tokens:
        limit = s_max + (boost if steps == boost_at else 0.0)
        qa, qb, qc = c / 2.0, b + c * depth, a + e * depth - limit
        if qc >= 0:
            return None
        n = int(-qc / qb) if qa <= 0 else int((-qb + math.sqrt(qb * qb - 4 * qa * qc)) / (2 * qa))
        if n < 1:
            return None
        n = min(n, long_tokens - depth)
        total += a + b * n + c * attention_work(n, depth) + e * depth
        depth += n
        steps += 1
    return steps, total


def min_long_ttft(
    coef: tuple[float, float, float],
    long_tokens: int,
    s_max: float,
    slack: float = 0.0,
    work: float | None = None,
) -> tuple[int, float] | None:
    """(steps, least long TTFT s) with every long step <= ``s_max`` save ``slack`` s in all; None when
    not even one token fits a step at the prompt's end."""
    a, b, c = coef
    if a + b + c * long_tokens > s_max:
        return None
    w = b * long_tokens + c * attention_work(long_tokens, 0) if work is None else work
    steps = max(1, math.ceil(max(w - slack, 0.0) / (s_max - a)))
    return steps, steps * a + w


def greedy_steps(coef: tuple[float, float, float], long_tokens: int, s_max: float) -> int | None:
    """Steps of the greedy chunking (the largest chunk within ``s_max`` at each depth): a check of
    ``min_long_ttft`` that the token granularity does not matter."""
    a, b, c = coef
    depth = steps = 0
    while depth < long_tokens:
        qa, qb, qc = c / 2.0, b + c * depth, a - s_max
        if qc >= 0:
            return None
        n = int(-qc / qb) if qa <= 0 else int((-qb + math.sqrt(qb * qb - 4 * qa * qc)) / (2 * qa))
        if n < 1:
            return None
        depth += n
        steps += 1
    return steps


def bound(scene: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any] | None:
    by = {r["config"]: r for r in results}
    base, unchunked = by.get("no-long"), by.get("unchunked")
    if base is None or unchunked is None or not unchunked.get("long_ttft"):
        return None
    coef = fit(results)
    a, b, c = coef
    L = int(scene["long_tokens"])
    n_short = SHORT_PROMPT_MIN
    baseline = base["ttft_p99"]
    goal = SHORT_FACTOR * baseline
    s_own = a + b * n_short + c * attention_work(n_short, 0)
    s_max = goal - s_own
    U = unchunked["long_ttft"]
    shorts = max(r["shorts"] for r in results)
    misses = shorts - 1 - int(0.99 * shorts)
    slack = (misses + 1) * scene["gap_ms"][1] / 1e3
    w_fit = b * L + c * attention_work(L, 0)
    w_meas = U - a
    out: dict[str, Any] = {
        "a": a,
        "b": b,
        "c": c,
        "baseline_p99": baseline,
        "goal": goal,
        "s_own": s_own,
        "s_max": s_max,
        "unchunked": U,
        "unchunked_fit": a + w_fit,
        "w_fit": w_fit,
        "w_meas": w_meas,
        "misses": misses,
        "slack": slack,
        "one_token_step": a + b + c * L,
    }
    for name, w in (("fit", w_fit), ("meas", w_meas)):
        for tag, e in (("", 0.0), ("_slack", slack)):
            res = min_long_ttft(coef, L, s_max, e, w)
            out[f"steps_{name}{tag}"] = None if res is None else res[0]
            out[f"ttft_{name}{tag}"] = None if res is None else res[1]
            out[f"ratio_{name}{tag}"] = None if res is None else res[1] / U
    out["greedy_steps"] = greedy_steps(coef, L, s_max)
    coef4 = fit_with_depth(results) if not any(r.get("coef") for r in results) else None
    if coef4 is not None and coef4[3] > 0:
        res = greedy_cost(coef4, L, s_max)
        best = res
        if res is not None and slack > 0:
            # the p99's slack spent on one longer step, wherever it saves the most
            tries = (greedy_cost(coef4, L, s_max, k, slack) for k in range(res[0]))
            best = min((t for t in tries if t is not None), key=lambda t: t[1], default=res)
        # as in the bound above, also with the long prompt's work as measured (U - a): the chunking's
        # own cost (the per-chunk a + e depth) kept, the fit's view of the whole prefill replaced
        a4, b4, c4, _ = coef4
        w4 = b4 * L + c4 * attention_work(L, 0)

        def least(t: float) -> float:
            return min(t, t - w4 + (U - a4))

        out["depth_term"] = {
            "coef": coef4,
            "steps": None if res is None else res[0],
            "ttft": None if res is None else least(res[1]),
            "ratio": None if res is None else least(res[1]) / U,
            "ttft_slack": None if best is None else least(best[1]),
            "ratio_slack": None if best is None else least(best[1]) / U,
        }
    ratios = [out[k] for k in ("ratio_fit_slack", "ratio_meas_slack") if out[k] is not None]
    out["ratio"] = min(ratios) if ratios else math.inf

    def ratio_at(s: float, fixed: float = a) -> float:
        r = [min_long_ttft((fixed, b, c), L, s, slack, w) for w in (w_fit, U - fixed)]
        return min((x[1] / U for x in r if x is not None), default=math.inf)

    # the least step cap the long goal allows (bisection on S), and the baseline p99 it would need
    lo, hi = a + b + c * L, 100.0
    if ratio_at(hi) <= LONG_FACTOR:
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if ratio_at(mid) <= LONG_FACTOR else (mid, hi)
        out["s_needed"] = hi
        out["baseline_needed"] = (hi + s_own) / SHORT_FACTOR
    # the largest fixed cost a that meets both goals, the rest as measured (s_own moves with a)
    lo, hi = 0.0, a
    if ratio_at(goal - (s_own - a) - lo, lo) <= LONG_FACTOR:
        for _ in range(80):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ratio_at(goal - (s_own - a) - mid, mid) <= LONG_FACTOR else (lo, mid)
        out["a_needed"] = lo
    return out


def report(scene: dict[str, Any], results: list[dict[str, Any]]) -> str:
    out = bound(scene, results)
    if out is None:
        return "hol_bound: needs the no-long and unchunked configurations"
    ms = 1e3

    def f(key: str, scale: float = ms, fmt: str = ".0f") -> str:
        v = out.get(key)
        return "-" if v is None else format(v * scale, fmt)

    lines = [
        "lower bound (bench/hol_bound.py): the least long TTFT of any policy meeting the short goal",
        f"  step {'model (given)' if any(r.get('coef') for r in results) else 'fit (all but unchunked)'}: "
        f"{out['a'] * ms:.2f} ms + {out['b'] * 1e6:.2f} us/token "
        f"+ {out['c'] * 1e9:.3f} ns/attention work; predicts the unchunked long step "
        f"{f('unchunked_fit')} ms (measured long TTFT {f('unchunked')} ms)",
        f"  short goal: TTFT p99 <= {SHORT_FACTOR:g} x {f('baseline_p99', fmt='.1f')} "
        f"= {f('goal', fmt='.1f')} ms; "
        f"a short's own step >= {f('s_own', fmt='.1f')} ms, so every step the long prompt is in must "
        f"be <= S_max = {f('s_max', fmt='.1f')} ms ({out['misses']} shorts may miss: "
        f"{f('slack')} ms over S_max granted in all)",
        f"  a 1-token step at depth {scene['long_tokens']} takes {f('one_token_step', fmt='.1f')} ms; "
        f"long prompt work W = {f('w_fit')} ms (fit) / {f('w_meas')} ms (measured unchunked - a)",
        f"  steps >= ceil((W - slack) / (S_max - a)) = {out['steps_fit_slack']} / {out['steps_meas_slack']} "
        f"(greedy chunking, no slack: {out['greedy_steps']}); long TTFT >= steps x a + W = "
        f"{f('ttft_fit_slack')} / {f('ttft_meas_slack')} ms",
        f"  bound: long TTFT >= {out['ratio']:.2f}x unchunked (goal <= {LONG_FACTOR:g}x; without the p99 "
        f"slack {f('ratio_fit', 1, '.2f')} / {f('ratio_meas', 1, '.2f')}x)",
    ]
    dt = out.get("depth_term")
    if dt:
        a4, b4, c4, e4 = dt["coef"]
        lines.append(
            f"  with the per-chunk depth term ({a4 * ms:.2f} ms + {b4 * 1e6:.2f} us/token + {c4 * 1e9:.3f} "
            f"ns/work + {e4 * 1e9:.0f} ns/token of chunk depth): "
            + (
                f"greedy chunking within S_max (the fastest under this model) takes {dt['steps']} steps, "
                f"long TTFT >= {dt['ttft'] * ms:.0f} ms = {dt['ratio']:.2f}x unchunked with the shorts' work "
                f"free (the lesser of the fit's and the measured prefill work); "
                f"{dt['ratio_slack']:.2f}x with the p99's slack spent on one longer step"
                if dt["steps"]
                else "no chunking keeps a step within S_max at the prompt's end"
            )
        )
    depth_ratio = (dt or {}).get("ratio_slack")
    if out["ratio"] <= LONG_FACTOR and depth_ratio is not None and depth_ratio > LONG_FACTOR:
        lines.append(
            f"  => without the depth term the bound ({out['ratio']:.2f}x) does not rule the goal out; with "
            f"it, the step cost measured here does: no chunking within S_max reaches {LONG_FACTOR:g}x "
            f"({depth_ratio:.2f}x at best), so the goal is out of reach on this engine at this baseline"
        )
    elif out["ratio"] > LONG_FACTOR:
        need = []
        if "s_needed" in out:
            need.append(
                f"steps up to {f('s_needed', fmt='.1f')} ms, i.e. a baseline p99 of "
                f"{f('baseline_needed', fmt='.1f')} ms with this step cost"
            )
        if "a_needed" in out:
            need.append(f"a fixed step cost <= {f('a_needed', fmt='.2f')} ms with this baseline")
        lines.append("  => no scheduling policy meets both goals here; it would take " + " or ".join(need))
    else:
        lines.append("  => the bound does not rule the goal out: a policy within S_max may meet both")
    return "\n".join(lines)


def from_constants(
    a: float, b: float, c: float, baseline: float, unchunked: float, long_tokens: int, shorts: int = 230
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A scene and results that make :func:`bound` use the given fit and figures (s, s/token, s/work)."""
    scene = {"long_tokens": long_tokens, "gap_ms": [20.0, 50.0]}
    results = [
        {"config": "no-long", "ttft_p99": baseline, "shorts": shorts, "long_ttft": None},
        {"config": "unchunked", "ttft_p99": 0.0, "shorts": shorts, "long_ttft": unchunked},
        {"config": "fit", "shorts": shorts, "step_records": [], "coef": (a, b, c)},
    ]
    return scene, results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("json", nargs="?", help="a file written by bench/head_of_line.py --json")
    parser.add_argument(
        "--constants",
        help="A_MS,B_US,C_NS,BASELINE_P99_MS,UNCHUNKED_MS[,LONG_TOKENS]: the bound from these figures "
        "instead of a run (e.g. another machine's); with --sweep-a, for fixed costs from 1 ms to A_MS",
    )
    parser.add_argument("--sweep-a", action="store_true", help="with --constants: the bound for a = 1..A ms")
    args = parser.parse_args()
    if args.constants:
        v = [float(x) for x in args.constants.split(",")]
        a, b, c, base, unch = v[0] / 1e3, v[1] / 1e6, v[2] / 1e9, v[3] / 1e3, v[4] / 1e3
        n = int(v[5]) if len(v) > 5 else 16000
        if not args.sweep_a:
            print(report(*from_constants(a, b, c, base, unch, n)))
            return
        print(f"  {'a ms':>6} {'b us/tok':>9} {'S_max ms':>9} {'steps':>6} {'long TTFT >=':>12} {'ratio':>6}")
        fixed_plus = a + 256 * b  # keep the measured depth-0 256-token step: b moves with a
        for tenth in range(10, int(a * 1e4) + 1, 5):
            ai = tenth / 1e4
            bi = max(fixed_plus - ai, 0.0) / 256
            out = bound(*from_constants(ai, bi, c, base, unch, n))
            if out is None:
                continue
            steps = out["steps_meas_slack"] or out["steps_fit_slack"]
            ttft = min(x for x in (out["ttft_fit_slack"], out["ttft_meas_slack"]) if x is not None)
            print(
                f"  {ai * 1e3:6.1f} {bi * 1e6:9.1f} {out['s_max'] * 1e3:9.1f} {steps!s:>6} "
                f"{ttft * 1e3:12.0f} {out['ratio']:6.2f}"
            )
        return
    if not args.json:
        parser.error("give a JSON file from head_of_line.py --json, or --constants")
    data = json.loads(Path(args.json).read_text())
    print(report(data["scene"], data["results"]))


if __name__ == "__main__":
    main()
