"""Loop-detector benchmark: the live rule side by side with vLLM's repetition detection and a brute force.

On the shipped corpus (``tools.loop_corpus``: legitimate outputs with repetition of every kind, exact
loops with log-uniform periods 1..512 after up to ~3,000 tokens of normal text, drifting loops and
near-loops) it prints, per detector: false positives on the legitimate outputs, recall, and the delay
(tokens of the loop produced before the cut, ``at - onset + 1``) p50/p90, also by period octave, and the
cost per token: the compiled detector (``ledger.rules._loopc``, the live one) beside the pure-Python
reference (``PyLoopDetector``) in the same run, and ``extend_many`` for a fleet (8,000 live requests
getting 1-4 ids each per call, one call per ingest group) beside one ``extend`` per request.

Detectors:
- ``live``: ``ledger.rules.loop`` with the default policy (``[rules.loop]``), fed 16 tokens per call as
  the ledger does; ``near`` the ``[rules.near_loop]`` rule with its settings (off by default);
- ``previous``: the detector's settings before this corpus (periods <= 64, 4 repeats, 128 tokens);
- ``vllm``: vLLM's ``SamplingParams.repetition_detection`` rule (``check_sequence_repetition``, run by
  vLLM's scheduler after every token): a pattern of ``min_pattern_size..max_pattern_size`` tokens
  repeated ``min_count`` times at the tail. Its default is off (``max_pattern_size=0``); the rows use
  the example settings of its docs (10, 1, 3) and wider ones. Its decisions are computed with the
  brute force below (the same rule, vectorised) and checked against vLLM's own function, imported when
  vLLM is installed, on every sample where that is affordable; its cost per token is vLLM's function
  called per token as its scheduler does;
- ``brute force``: every period at every token (numpy), the reference the live detector must equal.

    python -m bench.loopdetect [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np

from ledger.rules.loop import (
    COMPILED,
    LoopDetector,
    PyLoopDetector,
    exact_detector,
    extend_many,
    near_detector,
)
from ledger.rules.policy import LoopSettings, NearLoopSettings
from tools.loop_corpus import Sample, legit_corpus, loop_corpus, near_loop_corpus


def brute_force_first_hit(
    tokens: Sequence[int],
    *,
    max_period: int,
    min_repeats: int,
    min_span_tokens: int,
    min_period: int = 1,
    confirm_tokens: int = 0,
) -> int | None:
    """The first index where some period's tail spans min_repeats periods plus confirm_tokens, and
    min_span_tokens (exact)."""
    t = np.asarray(tokens, dtype=np.int64)
    n = len(t)
    best = n
    for p in range(min_period, min(max_period, n - 1) + 1):
        need = max(min_repeats * p + confirm_tokens, min_span_tokens) - p  # t[j] == t[j-p] in a row
        if need > n - p or p + need - 1 >= best:
            continue
        eq = t[p:] == t[:-p]
        # run of matches ending at each j: j - (last mismatch at or before j)
        idx = np.arange(len(eq))
        last_bad = np.maximum.accumulate(np.where(eq, -1, idx))
        run = idx - last_bad
        hits = np.flatnonzero(run >= need)
        if len(hits):
            best = min(best, int(hits[0]) + p)
    return None if best == n else best


def vllm_rule(max_pattern_size: int, min_pattern_size: int, min_count: int) -> Callable[[Sample], int | None]:
    """vLLM's repetition_detection decision on a whole output: the first token where it stops."""

    def first(s: Sample) -> int | None:
        return brute_force_first_hit(
            s.tokens,
            max_period=max_pattern_size,
            min_repeats=min_count,
            min_span_tokens=2,
            min_period=max(1, min_pattern_size),
        )

    return first


def vllm_check() -> Callable[..., bool] | None:
    try:
        from vllm.sampling_params import RepetitionDetectionParams
        from vllm.v1.core.sched.utils import check_sequence_repetition
    except Exception:
        return None

    def check(tokens: Sequence[int], mx: int, mn: int, count: int) -> bool:
        return check_sequence_repetition(tokens, RepetitionDetectionParams(mx, mn, count))

    return check


def vllm_first_by_its_function(
    check: Callable[..., bool], s: Sample, mx: int, mn: int, count: int
) -> int | None:
    """Call vLLM's function after every token, as its scheduler does."""
    out: list[int] = []
    for i, tok in enumerate(s.tokens):
        out.append(tok)
        if check(out, mx, mn, count):
            return i
    return None


def live_rule(make: Callable[[], LoopDetector], group: int = 16) -> Callable[[Sample], int | None]:
    def first(s: Sample) -> int | None:
        d = make()
        toks = s.tokens
        for k in range(0, len(toks), group):
            h = d.extend(toks[k : k + group])
            if h is not None:
                return h.at
        return None

    return first


def _octave(p: int) -> str:
    if p >= 512:
        return "512"
    lo = 1 << int(math.log2(p))
    return f"{lo}-{2 * lo - 1}" if lo > 1 else "1"


def measure(name: str, first: Callable[[Sample], int | None], legit: list, loops: list) -> dict:
    fps = [s.id for s in legit if first(s) is not None]
    rows = []
    for s in loops:
        at = first(s)
        caught = at is not None and at >= s.onset
        rows.append((s, at, caught, (at - s.onset + 1) if caught else None))
    out = {"name": name, "false_positives": len(fps), "fp_ids": fps[:8]}
    for kind in ("exact", "drift", "near"):
        sel = [r for r in rows if r[0].kind == kind]
        if not sel:
            continue
        delays = [r[3] for r in sel if r[3] is not None]  # None: not caught
        over = [r[3] - 2 * r[0].period for r in sel if r[3] is not None]
        q = statistics.quantiles(delays, n=10) if len(delays) > 1 else [delays[0] if delays else 0] * 9
        qo = statistics.quantiles(over, n=10) if len(over) > 1 else [over[0] if over else 0] * 9
        buckets: dict[str, list] = {}
        for s, _, caught, d in sel:
            buckets.setdefault(_octave(s.period), []).append(d if caught else None)
        out[kind] = {
            "samples": len(sel),
            "caught": len(delays),
            "recall": len(delays) / len(sel),
            "early": sum(1 for r in sel if r[1] is not None and r[1] < r[0].onset),
            "delay_p50": statistics.median(delays) if delays else None,
            "delay_p90": q[8] if delays else None,
            "delay_minus_2p_p90": qo[8] if delays else None,
            "by_octave": {
                k: {
                    "samples": len(v),
                    "caught": sum(d is not None for d in v),
                    "p50": statistics.median([d for d in v if d is not None])
                    if any(d is not None for d in v)
                    else None,
                    "p90": (
                        statistics.quantiles([d for d in v if d is not None], n=10)[8]
                        if sum(d is not None for d in v) > 1
                        else None
                    ),
                }
                for k, v in buckets.items()
            },
        }
    return out


def ns_per_token(
    make: Callable[[], LoopDetector | PyLoopDetector], samples: list, rounds: int = 3, group: int = 16
) -> float:
    """Best-of-``rounds`` ns per token, fed ``group`` tokens per call as the ledger does, one detector
    per output (none fires: thresholds out of reach, so every token is paid for)."""
    groups = [[s.tokens[k : k + group] for k in range(0, len(s.tokens), group)] for s in samples]
    n = sum(len(s.tokens) for s in samples)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for gs in groups:
            d = make()
            for g in gs:
                d.extend(g)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e9


def fleet_calls(
    samples: list, live: int = 8000, calls: int = 10, seed: int = 0
) -> tuple[list[list[int]], list[tuple[list[int], list[int]]]]:
    """A fleet of ``live`` requests, each replaying a corpus output from a random point: what each has
    produced so far (0-1,000 ids, fed before timing), then ``calls`` ingest groups in which every request
    gets 1-4 ids (counts and the flat ids, as ``extend_many`` takes them)."""
    rng = random.Random(seed)
    streams = [samples[k % len(samples)].tokens for k in range(live)]
    pos = [rng.randrange(len(s)) for s in streams]

    def take(k: int, c: int) -> list[int]:
        s, p = streams[k], pos[k]
        pos[k] = p + c
        return [s[(p + j) % len(s)] for j in range(c)]

    warm = [take(k, rng.randrange(1000)) for k in range(live)]
    groups = []
    for _ in range(calls):
        counts = [rng.randint(1, 4) for _ in range(live)]
        groups.append((counts, [t for k, c in enumerate(counts) for t in take(k, c)]))
    return warm, groups


def fleet_ns_per_token(
    make: Callable[[], object], warm: list[list[int]], groups: list, bulk: bool, rounds: int = 2
) -> float:
    """Best-of-``rounds`` ns per id over the fleet's groups (fresh detectors each round, fed ``warm``
    first): one ``extend_many`` per group, or one ``extend`` per request (its ids already a list)."""
    n = sum(len(flat) for _, flat in groups)
    split = []
    for counts, flat in groups:
        offs = list(itertools.accumulate(counts, initial=0))
        split.append([flat[a:b] for a, b in itertools.pairwise(offs)])
    best = float("inf")
    for _ in range(rounds):
        dets: list = [make() for _ in warm]
        for d, w in zip(dets, warm, strict=True):
            d.extend(w)
        t0 = time.perf_counter()
        if bulk:
            for counts, flat in groups:
                extend_many(dets, counts, flat)
        else:
            for parts in split:
                for d, ids in zip(dets, parts, strict=True):
                    d.extend(ids)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e9


def vllm_ns_per_token(check: Callable[..., bool], samples: list, mx: int, mn: int, count: int) -> float:
    n, t0 = 0, time.perf_counter()
    for s in samples:
        out: list[int] = []
        for tok in s.tokens:
            out.append(tok)
            check(out, mx, mn, count)
            n += 1
    return (time.perf_counter() - t0) / n * 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    legit, loops, near = legit_corpus(), loop_corpus(), near_loop_corpus()
    L, N = LoopSettings(), NearLoopSettings()
    prev = LoopSettings(max_period=64, min_repeats=4, min_span_tokens=128)
    print(
        f"corpus: {len(legit)} legitimate outputs ({sum(len(s.tokens) for s in legit):,} tokens), "
        f"{sum(s.kind == 'exact' for s in loops)} exact and {sum(s.kind == 'drift' for s in loops)} drifting "
        f"loops (periods log-uniform 1..512), {len(near)} near-loops"
    )
    print(
        f"live defaults: max_period {L.max_period}, min_repeats {L.min_repeats}, "
        f"min_span_tokens {L.min_span_tokens}"
    )

    # The live detector equals the brute force (both exact): count the samples where they differ.
    t0 = time.perf_counter()
    differ = []
    for s in legit + loops:
        ref = brute_force_first_hit(
            s.tokens, max_period=L.max_period, min_repeats=L.min_repeats, min_span_tokens=L.min_span_tokens
        )
        got = exact_detector(L).extend(s.tokens)
        if (got.at if got else None) != ref:
            differ.append(s.id)
    bf_s = time.perf_counter() - t0
    print(
        f"live vs brute force: {len(legit) + len(loops) - len(differ)} of {len(legit) + len(loops)} "
        f"outputs cut at the same token ({bf_s:.1f} s)"
        + (f"; later on: {', '.join(differ[:5])}" if differ else "")
    )

    vllm_settings = [(10, 1, 3), (10, 3, 3), (64, 1, 4), (512, 1, 2), (512, 1, 3)]
    results = [
        measure("live", live_rule(lambda: exact_detector(L)), legit, loops + near),
        measure(
            "live near_loop rule",
            live_rule(lambda: near_detector(N.model_copy(update={"enabled": True}))),
            legit,
            loops + near,
        ),
        measure("previous (64/4/128)", live_rule(lambda: exact_detector(prev)), legit, loops + near),
    ]
    for mx, mn, c in vllm_settings:
        results.append(measure(f"vllm ({mx},{mn},{c})", vllm_rule(mx, mn, c), legit, loops + near))

    check = vllm_check()
    agree = None
    if check is not None:
        # vLLM's own function after every token, on the samples where that is affordable (it checks
        # every pattern size at every token: O(max_pattern_size) per token)
        mx, mn, c = vllm_settings[0]
        sub = [s for s in legit[::4] + loops[::8]]
        same = sum(vllm_first_by_its_function(check, s, mx, mn, c) == vllm_rule(mx, mn, c)(s) for s in sub)
        agree = (same, len(sub))
        print(
            f"vLLM's check_sequence_repetition vs its rule here (10,1,3): {same} of {len(sub)} outputs agree"
        )
    else:
        print("vLLM is not installed: its rule is the reimplementation from its source (same decisions)")

    head = (
        f"{'detector':<22} {'FP':>4} {'recall':>7} {'drift':>6} {'near':>5} {'p50':>5} {'p90':>6} "
        f"{'p90-2p':>7}"
    )
    print(head)
    for r in results:
        ex, dr, nr = r["exact"], r["drift"], r["near"]
        print(
            f"{r['name']:<22} {r['false_positives']:>4} {ex['recall']:>7.1%} {dr['recall']:>6.1%} "
            f"{nr['recall']:>5.0%} {ex['delay_p50'] or 0:>5.0f} {ex['delay_p90'] or 0:>6.0f} "
            f"{ex['delay_minus_2p_p90'] or 0:>7.0f}"
        )
    live = results[0]["exact"]["by_octave"]
    print(
        "live, exact loops by period: "
        + "; ".join(
            f"{k}: {v['caught']}/{v['samples']} p50 {v['p50']:.0f} p90 {v['p90'] or v['p50']:.0f}"
            for k, v in live.items()
        )
    )
    sample = legit + loops[::3]
    never = {"min_repeats": 1 << 20, "min_span_tokens": 1 << 20}  # every token is paid for
    live_kw = {"max_period": L.max_period, **never}
    near_kw = {"max_period": N.max_period, "min_period": N.min_period, "changes": 1, **never}
    ns_live = ns_per_token(lambda: LoopDetector(**live_kw), sample)
    ns_near = ns_per_token(lambda: LoopDetector(**near_kw), sample)
    ns_py_live = ns_per_token(lambda: PyLoopDetector(**live_kw), sample)
    ns_py_near = ns_per_token(lambda: PyLoopDetector(**near_kw), sample)
    print(
        f"cost per token, 16 per call: live {ns_live:.0f} ns {'compiled' if COMPILED else '(NOT compiled)'}, "
        f"{ns_py_live:.0f} ns Python ({ns_py_live / ns_live:.0f}x); near_loop {ns_near:.0f} ns, "
        f"{ns_py_near:.0f} ns Python"
    )
    warm, groups = fleet_calls(sample)
    fleet = {
        "extend_many": fleet_ns_per_token(lambda: LoopDetector(**live_kw), warm, groups, bulk=True),
        "extend_per_request": fleet_ns_per_token(lambda: LoopDetector(**live_kw), warm, groups, bulk=False),
        "python_extend_per_request": fleet_ns_per_token(
            lambda: PyLoopDetector(**live_kw), warm, groups, bulk=False, rounds=1
        ),
    }
    print(
        f"fleet of {len(warm):,} live requests, 1-4 ids each per group: extend_many "
        f"{fleet['extend_many']:.0f} ns per id; one extend per request {fleet['extend_per_request']:.0f} ns "
        f"compiled, {fleet['python_extend_per_request']:.0f} ns Python",
        end="",
    )
    ns_vllm = {}
    if check is not None:
        few = legit[:12]
        for mx, mn, c in ((10, 1, 3), (512, 1, 2)):
            ns_vllm[f"{mx},{mn},{c}"] = vllm_ns_per_token(check, few, mx, mn, c)
        print("; vLLM's check per token: " + ", ".join(f"({k}) {v:,.0f} ns" for k, v in ns_vllm.items()))
    else:
        print()
    if args.json:
        print(
            json.dumps(
                {
                    "results": results,
                    "compiled": COMPILED,
                    "ns_per_token": ns_live,
                    "near_ns_per_token": ns_near,
                    "python_ns_per_token": ns_py_live,
                    "python_near_ns_per_token": ns_py_near,
                    "fleet_ns_per_token": fleet,
                    "vllm_ns_per_token": ns_vllm,
                    "brute_force_differ": differ,
                    "vllm_agree": agree,
                }
            )
        )


if __name__ == "__main__":
    main()
