"""Loop-detector benchmark: false positives, detection delay and per-token cost, with the live defaults.

Runs the detector (``ledger.rules.loop``) with the default policy's loop settings over the shipped corpus
(``ledger.rules.corpus``): legitimate outputs with repetition (tables, code, enumerations, JSON arrays)
must not be flagged; degenerate outputs (a block of 1..max_period tokens repeated) must be, soon after
the loop starts. Also measures the cost per token (one detector fed token by token, as the live engine
does) next to the bare loop over the same tokens, and a sweep of the thresholds around the defaults.

    python bench/loopdetect.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ledger.rules.corpus import legit_corpus, loop_corpus
from ledger.rules.loop import LoopDetector
from ledger.rules.policy import LoopSettings


def measure(s: LoopSettings, legit: list, loops: list) -> dict:
    def det() -> LoopDetector:
        return LoopDetector(
            max_period=s.max_period, min_repeats=s.min_repeats, min_span_tokens=s.min_span_tokens
        )

    fps = [x.id for x in legit if det().extend(x.tokens) is not None]
    delays, periods, missed, early = [], [], 0, 0
    for x in loops:
        if x.period > s.max_period:
            continue
        h = det().extend(x.tokens)
        if h is None:
            missed += 1
            continue
        if h.at < x.onset:
            early += 1
            continue
        d = h.at - x.onset + 1  # tokens of the loop produced before the cut
        delays.append(d)
        periods.append(d / x.period)
    q = statistics.quantiles(delays, n=100) if len(delays) > 1 else [0] * 99
    return {
        "max_period": s.max_period,
        "min_repeats": s.min_repeats,
        "min_span_tokens": s.min_span_tokens,
        "legit_samples": len(legit),
        "false_positives": len(fps),
        "fp_rate": len(fps) / len(legit),
        "fp_ids": fps,
        "loop_samples": len(delays) + missed + early,
        "missed": missed,
        "flagged_before_onset": early,
        "delay_tokens_p50": q[49],
        "delay_tokens_p90": q[89],
        "delay_tokens_p99": q[98],
        "delay_tokens_max": max(delays, default=0),
        "delay_periods_p50": statistics.median(periods) if periods else 0,
    }


def per_token_cost(s: LoopSettings, samples: list, rounds: int = 5, group: int = 16) -> tuple[float, float]:
    """Best-of-``rounds`` ns per token, fed ``group`` tokens per call as the live engine does (one call
    per coalesced tokens event), next to a bare Python loop appending the same tokens."""
    tokens = [t for x in samples for t in x.tokens]
    groups = [tokens[i : i + group] for i in range(0, len(tokens), group)]
    best = bare = float("inf")
    for _ in range(rounds):
        d = LoopDetector(max_period=s.max_period, min_repeats=2 << 30, min_span_tokens=2 << 30)
        t0 = time.perf_counter()
        for g in groups:
            d.extend(g)
        best = min(best, time.perf_counter() - t0)
        acc: list[int] = []
        t0 = time.perf_counter()
        for g in groups:
            for t in g:
                acc.append(t)
        bare = min(bare, time.perf_counter() - t0)
    return best / len(tokens) * 1e9, bare / len(tokens) * 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    default = LoopSettings()
    legit = legit_corpus()
    loops = loop_corpus(max_period=default.max_period)
    results = [measure(default, legit, loops)]
    for kw in (
        {"min_span_tokens": 64},
        {"min_span_tokens": 96},
        {"min_span_tokens": 192},
        {"min_repeats": 3},
        {"min_repeats": 6},
    ):
        results.append(measure(default.model_copy(update=kw), legit, loops))
    ns, bare = per_token_cost(default, legit + loops[:60])
    n_legit = sum(len(x.tokens) for x in legit)
    print(
        f"corpus: {len(legit)} legitimate outputs ({n_legit} tokens), "
        f"{len(loops)} loops (periods 1..{default.max_period})"
    )
    head = ("max_period", "repeats", "span", "FP", "missed", "delay p50", "p90", "p99", "max", "periods p50")
    widths = (10, 7, 5, 4, 6, 9, 5, 5, 5, 11)
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, widths, strict=True)))
    for r in results:
        cells = (
            r["max_period"],
            r["min_repeats"],
            r["min_span_tokens"],
            r["false_positives"],
            r["missed"],
            round(r["delay_tokens_p50"]),
            round(r["delay_tokens_p90"]),
            round(r["delay_tokens_p99"]),
            r["delay_tokens_max"],
            round(r["delay_periods_p50"], 1),
        )
        mark = "  <- default" if r is results[0] else ""
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)) + mark)
        if r["fp_ids"]:
            print(f"{'':>10} false positives: {', '.join(r['fp_ids'])}")
    print(
        f"per-token cost: {ns:.0f} ns, fed 16 tokens per call (a bare Python loop appending the same "
        f"tokens: {bare:.0f} ns)"
    )
    if args.json:
        print(json.dumps({"results": results, "ns_per_token": ns, "bare_ns_per_token": bare}))


if __name__ == "__main__":
    main()
