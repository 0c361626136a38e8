"""Loop-detector benchmark: every loop rule side by side with vLLM's repetition detection and a brute force.

On the shipped corpus (``tools.loop_corpus``: legitimate outputs with repetition of every kind, rows
that differ in one cell among them; exact loops with log-uniform periods 1..512 after up to ~3,000
tokens of normal text, drifting loops, counter loops and paraphrase loops) it prints, per detector:
false positives on the legitimate outputs, recall per kind of loop, and the delay on exact loops
(tokens of the loop produced before the cut, ``at - onset + 1``) p50/p90, the p90 of the delay minus
two periods and the share cut within two periods + 64 tokens, also by period octave; then the cost per
token of each rule and of all of them together as the rule engine feeds them (one run, side by side),
the compiled detector beside the pure-Python reference, ``extend_many`` for a fleet (8,000 live
requests getting 1-4 ids each per call) beside one ``extend`` per request, and vLLM's check.

Detectors:
- ``loop``, ``near_loop``, ``paraphrase_loop``: the rules with the default policy (the paraphrase rule
  is off by default: its row is what it would cut), fed 16 tokens per call as the ledger does;
  ``defaults`` the first cut of the rules on by default, ``all three`` with the paraphrase rule too;
- ``flat 72``: the loop rule's settings before (``min_span_tokens = 72``, no confirmation);
- ``vllm``: vLLM's ``SamplingParams.repetition_detection`` rule (``check_sequence_repetition``, run by
  vLLM's scheduler after every token): a pattern of ``min_pattern_size..max_pattern_size`` tokens
  repeated ``min_count`` times at the tail. Its default is off (``max_pattern_size=0``); the rows use
  the example settings of its docs (10, 1, 3) and wider ones. Its decisions are computed with the
  brute force below (the same rule, vectorised) and checked against vLLM's own function, imported when
  vLLM is installed, on every sample where that is affordable; its cost per token is vLLM's function
  called per token as its scheduler does;
- ``brute force``: every period at every token (numpy), the reference the loop rule must equal.

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
from typing import Any

import numpy as np

from ledger.rules.loop import (
    COMPILED,
    LoopDetector,
    PyLoopDetector,
    exact_detector,
    extend_many,
    near_detector,
)
from ledger.rules.paraphrase import ParaphraseDetector, PyParaphraseDetector, paraphrase_detector
from ledger.rules.policy import LoopSettings, NearLoopSettings, ParaphraseLoopSettings
from tools.loop_corpus import Sample, legit_corpus, loop_corpus, near_loop_corpus, paraphrase_loop_corpus


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


def live_rule(*makes: Callable[[], Any], group: int = 16) -> Callable[[Sample], int | None]:
    """The first cut of the detectors ``makes`` make, fed ``group`` tokens per call as the ledger does."""

    def first(s: Sample) -> int | None:
        ats = []
        for make in makes:
            d, toks = make(), s.tokens
            for k in range(0, len(toks), group):
                h = d.extend(toks[k : k + group])
                if h is not None:
                    ats.append(h.at)
                    break
        return min(ats, default=None)

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
    for kind in ("exact", "drift", "near", "paraphrase"):
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
            "within_2p_64": sum(1 for o in over if o <= 64) / len(sel),
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
    makes: Sequence[Callable[[], Any]], samples: list, rounds: int = 3, group: int = 16
) -> float:
    """Best-of-``rounds`` ns per token, fed ``group`` tokens per call as the ledger does to one detector
    of each of ``makes`` per output (none fires: thresholds out of reach, so every token is paid for)."""
    groups = [[s.tokens[k : k + group] for k in range(0, len(s.tokens), group)] for s in samples]
    n = sum(len(s.tokens) for s in samples)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for gs in groups:
            dets = [make() for make in makes]
            for g in gs:
                for d in dets:
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
    makes: Sequence[Callable[[], Any]], warm: list[list[int]], groups: list, bulk: bool, rounds: int = 2
) -> float:
    """Best-of-``rounds`` ns per id over the fleet's groups (fresh detectors each round, fed ``warm``
    first), each request with one detector of each of ``makes``: all fed in one ``extend_many`` per
    group (``bulk``, as the rule engine does; its lists built before the clock starts) or by one
    ``extend`` each per request (its ids already a list)."""
    n = sum(len(flat) for _, flat in groups)
    per = len(makes)
    split, many = [], []
    for counts, flat in groups:
        offs = list(itertools.accumulate(counts, initial=0))
        parts = [flat[a:b] for a, b in itertools.pairwise(offs)]
        split.append(parts)
        many.append(
            ([c for c in counts for _ in range(per)], [t for ids in parts for _ in range(per) for t in ids])
        )
    best = float("inf")
    for _ in range(rounds):
        dets = [make() for _ in warm for make in makes]
        for k, d in enumerate(dets):
            d.extend(warm[k // per])
        t0 = time.perf_counter()
        for (counts, flat), parts in zip(many, split, strict=True):
            if bulk:
                extend_many(dets, counts, flat)
            else:
                for k, d in enumerate(dets):
                    d.extend(parts[k // per])
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


def check_brute_force(L: LoopSettings, samples: list[Sample]) -> list[str]:
    """The loop rule equals the brute force (both exact): the samples where they differ."""
    differ = []
    for s in samples:
        ref = brute_force_first_hit(
            s.tokens,
            max_period=L.max_period,
            min_repeats=L.min_repeats,
            min_span_tokens=L.min_span_tokens,
            confirm_tokens=L.confirm_tokens,
        )
        got = exact_detector(L).extend(s.tokens)
        if (got.at if got else None) != ref:
            differ.append(s.id)
    return differ


VLLM_SETTINGS = [(10, 1, 3), (10, 3, 3), (64, 1, 4), (512, 1, 2), (512, 1, 3)]


def detection_rows(legit: list[Sample], loops: list[Sample]) -> list[dict]:
    """Every rule, the defaults together, the loop rule's previous settings and vLLM's, on the corpus."""
    L, N, P = LoopSettings(), NearLoopSettings(), ParaphraseLoopSettings(enabled=True)
    flat72 = L.model_copy(update={"min_span_tokens": 72, "confirm_tokens": 0})
    exact, near, para = (
        (lambda: exact_detector(L)),
        (lambda: near_detector(N)),
        (lambda: paraphrase_detector(P)),
    )
    rows = [
        measure("loop", live_rule(exact), legit, loops),
        measure("near_loop", live_rule(near), legit, loops),
        measure("paraphrase_loop (off)", live_rule(para), legit, loops),
        measure("defaults (loop+near)", live_rule(exact, near), legit, loops),
        measure("all three", live_rule(exact, near, para), legit, loops),
        measure("loop, flat 72 (before)", live_rule(lambda: exact_detector(flat72)), legit, loops),
    ]
    rows += [
        measure(f"vllm ({mx},{mn},{c})", vllm_rule(mx, mn, c), legit, loops) for mx, mn, c in VLLM_SETTINGS
    ]
    return rows


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'detector':<24} {'FP':>4} {'exact':>7} {'drift':>6} {'counter':>8} {'paraphr':>8} {'p50':>5} "
        f"{'p90':>5} {'p90-2p':>7} {'<=2p+64':>8}"
    )
    for r in rows:
        ex, dr, nr, pa = r["exact"], r["drift"], r["near"], r["paraphrase"]
        print(
            f"{r['name']:<24} {r['false_positives']:>4} {ex['recall']:>7.1%} {dr['recall']:>6.1%} "
            f"{nr['recall']:>8.1%} {pa['recall']:>8.1%} {ex['delay_p50'] or 0:>5.0f} "
            f"{ex['delay_p90'] or 0:>5.0f} {ex['delay_minus_2p_p90'] or 0:>7.0f} {ex['within_2p_64']:>8.1%}"
        )
    live = rows[0]["exact"]["by_octave"]
    print(
        "loop, exact loops by period: "
        + "; ".join(
            f"{k}: {v['caught']}/{v['samples']} p50 {v['p50']:.0f} p90 {v['p90'] or v['p50']:.0f}"
            for k, v in live.items()
        )
    )
    for name, kind in (("near_loop", "near"), ("paraphrase_loop (off)", "paraphrase")):
        r = next(x for x in rows if x["name"] == name)[kind]
        print(
            f"{name}, {kind} loops: {r['caught']}/{r['samples']} caught, "
            f"delay p50 {r['delay_p50'] or 0:.0f} p90 {r['delay_p90'] or 0:.0f}"
        )


def costs(legit: list[Sample], loops: list[Sample]) -> dict:
    """ns per token of each rule and of all together, compiled and Python, 16 per call and a fleet."""
    L, N = LoopSettings(), NearLoopSettings()
    never = {"min_repeats": 1 << 20, "min_span_tokens": 1 << 20}  # every token is paid for
    loop_kw = {"max_period": L.max_period, **never}
    near_kw = {"max_period": N.max_period, "min_period": N.min_period, "changes": 1, **never}
    para_kw = {"min_vocabulary": 1 << 20}  # counts everything, never fires
    loop, near = (lambda: LoopDetector(**loop_kw)), (lambda: LoopDetector(**near_kw))
    para = lambda: ParaphraseDetector(**para_kw)  # noqa: E731
    sample = legit + loops[::3]
    out = {
        "loop": ns_per_token([loop], sample),
        "near_loop": ns_per_token([near], sample),
        "paraphrase_loop": ns_per_token([para], sample),
        "all": ns_per_token([loop, near, para], sample),
        "python_loop": ns_per_token([lambda: PyLoopDetector(**loop_kw)], sample, rounds=1),
        "python_near_loop": ns_per_token([lambda: PyLoopDetector(**near_kw)], sample, rounds=1),
        "python_paraphrase_loop": ns_per_token([lambda: PyParaphraseDetector(**para_kw)], sample, rounds=1),
    }
    warm, groups = fleet_calls(sample)
    out["fleet_loop_extend_many"] = fleet_ns_per_token([loop], warm, groups, bulk=True)
    out["fleet_loop_extend_per_request"] = fleet_ns_per_token([loop], warm, groups, bulk=False)
    out["fleet_defaults_extend_many"] = fleet_ns_per_token([loop, near], warm, groups, bulk=True)
    out["fleet_all_extend_many"] = fleet_ns_per_token([loop, near, para], warm, groups, bulk=True)
    out["fleet_all_extend_per_request"] = fleet_ns_per_token([loop, near, para], warm, groups, bulk=False)
    return out


def print_costs(c: dict, ns_vllm: dict) -> None:
    compiled = "compiled" if COMPILED else "(NOT compiled)"
    print(
        f"cost per token, 16 per call ({compiled}; the Python reference): loop {c['loop']:.0f} ns "
        f"({c['python_loop']:.0f}), near_loop {c['near_loop']:.0f} ns ({c['python_near_loop']:.0f}), "
        f"paraphrase_loop {c['paraphrase_loop']:.0f} ns ({c['python_paraphrase_loop']:.0f}); "
        f"all three together {c['all']:.0f} ns"
    )
    print(
        f"fleet of 8,000 live requests, 1-4 ids each per group: loop by extend_many "
        f"{c['fleet_loop_extend_many']:.0f} ns per id, by one extend per request "
        f"{c['fleet_loop_extend_per_request']:.0f} ns; the defaults (loop, near_loop) by extend_many "
        f"{c['fleet_defaults_extend_many']:.0f} ns; all three by extend_many "
        f"{c['fleet_all_extend_many']:.0f} ns, by one extend each per request "
        f"{c['fleet_all_extend_per_request']:.0f} ns"
        + (
            "; vLLM's check per token: " + ", ".join(f"({k}) {v:,.0f} ns" for k, v in ns_vllm.items())
            if ns_vllm
            else ""
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    legit, loops = legit_corpus(), loop_corpus()
    loops_all = loops + near_loop_corpus() + paraphrase_loop_corpus()
    L, N = LoopSettings(), NearLoopSettings()
    kinds = {k: sum(s.kind == k for s in loops_all) for k in ("exact", "drift", "near", "paraphrase")}
    print(
        f"corpus: {len(legit)} legitimate outputs ({sum(len(s.tokens) for s in legit):,} tokens), "
        f"{kinds['exact']} exact and {kinds['drift']} drifting loops (periods log-uniform 1..512), "
        f"{kinds['near']} counter loops, {kinds['paraphrase']} paraphrase loops"
    )
    print(
        f"defaults: loop span max({L.min_span_tokens}, {L.min_repeats}p + {L.confirm_tokens}), periods "
        f"1..{L.max_period}; near_loop {'on' if N.enabled else 'off'}, span max({N.min_span_tokens}, "
        f"{N.min_repeats}p), periods {N.min_period}..{N.max_period}; paraphrase_loop off"
    )
    t0 = time.perf_counter()
    differ = check_brute_force(L, legit + loops)
    print(
        f"loop vs brute force: {len(legit) + len(loops) - len(differ)} of {len(legit) + len(loops)} "
        f"outputs cut at the same token ({time.perf_counter() - t0:.1f} s)"
        + (f"; later on: {', '.join(differ[:5])}" if differ else "")
    )
    check, agree, ns_vllm = vllm_check(), None, {}
    if check is not None:
        # vLLM's own function after every token, on the samples where that is affordable (it checks
        # every pattern size at every token: O(max_pattern_size) per token)
        mx, mn, c = VLLM_SETTINGS[0]
        sub = legit[::4] + loops[::8]
        same = sum(vllm_first_by_its_function(check, s, mx, mn, c) == vllm_rule(mx, mn, c)(s) for s in sub)
        agree = (same, len(sub))
        print(
            f"vLLM's check_sequence_repetition vs its rule here (10,1,3): {same} of {len(sub)} outputs agree"
        )
        for mx, mn, c in ((10, 1, 3), (512, 1, 2)):
            ns_vllm[f"{mx},{mn},{c}"] = vllm_ns_per_token(check, legit[:12], mx, mn, c)
    else:
        print("vLLM is not installed: its rule is the reimplementation from its source (same decisions)")
    rows = detection_rows(legit, loops_all)
    print_rows(rows)
    cost = costs(legit, loops)
    print_costs(cost, ns_vllm)
    if args.json:
        print(
            json.dumps(
                {
                    "results": rows,
                    "compiled": COMPILED,
                    "ns_per_token": cost,
                    "vllm_ns_per_token": ns_vllm,
                    "brute_force_differ": differ,
                    "vllm_agree": agree,
                }
            )
        )


if __name__ == "__main__":
    main()
