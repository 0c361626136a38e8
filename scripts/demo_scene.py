"""The demo's load generator and its report (used by scripts/demo.sh).

    python scripts/demo_scene.py size --model DIR --workdir DIR [--long-prefill-s 3]
    python scripts/demo_scene.py run --phase NAME --gateway URL --ledger URL --engine-source ID \
        --duration 30 --long-tokens 20000 --short-rps 4 --out phases.json
    python scripts/demo_scene.py advise --ledger URL --engine-source ID --itl-target-ms 50
    python scripts/demo_scene.py report --ledger URL --phases phases.json [--check]

The scene: a stream of short requests (Poisson arrivals, 48-80-token prompts, 24 output tokens), a long
prompt arriving at the head of the queue a few seconds in, and a runaway request that never stops on
its own (no max_tokens, EOS ignored) for the ledger's rules to cut, and a witness: a request decoding
(64 tokens) when the long prompt arrives, whose largest gap between tokens is what the long prompt's
steps cost a running decode. Prompts are token ids, so their
lengths are exact. ``size`` sizes it for the engine at hand (ledger.advice.scene, from a short
``chunkledger profile`` plan): the shorts' rate keeps the engine at most half busy, the long prompt's
prefill takes at least 3 s. Every figure in the report comes from the ledger's API: the short requests'
TTFT p99 before the long prompt arrived (the phase's own baseline) and overall, its split into layers,
the decode ITL p99 of the phase's window, the culprit the "why" list names for the slowest short
request (the long prompt, with its length and chunks), and the cutoff that fired.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

SHORT_PROMPT = (48, 80)
SHORT_OUTPUT = 24
LONG_OUTPUT = 8
SHORT_MAX_PROMPT = 1000  # what counts as a "short" request in the report
RUNAWAY_PROMPT = 32  # the runaway's prompt length: how the report finds it (shorts have 48..80)
# A request decoding when the long prompt arrives (sent WITNESS_LEAD_S before it, 40 prompt tokens, 64
# out: under the loop rule's 128-token span and the cap): its largest inter-token gap is what the long
# prompt's steps cost a running decode (the whole prefill unchunked, one chunk's step chunked).
WITNESS_PROMPT = 40
WITNESS_OUTPUT = 64
WITNESS_LEAD_S = 0.1


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1300) for _ in range(n)]


def _complete(client: httpx.Client, body: dict[str, Any], sink: list[dict[str, Any]], label: str) -> None:
    t0 = time.monotonic()
    first = None
    status = 0
    try:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            status = r.status_code
            for line in r.iter_lines():
                if first is None and line.startswith("data: ") and line != "data: [DONE]":
                    first = time.monotonic() - t0
    except httpx.HTTPError as exc:
        sink.append({"label": label, "error": str(exc)})
        return
    sink.append(
        {"label": label, "status": status, "client_ttft_s": first, "client_e2e_s": time.monotonic() - t0}
    )


def run_phase(args: argparse.Namespace) -> None:
    """Drive one phase through the gateway and record its window and settings."""
    rng = random.Random(args.seed)
    client = httpx.Client(base_url=args.gateway, timeout=httpx.Timeout(600.0, connect=5.0))
    results: list[dict[str, Any]] = []
    threads: list[threading.Thread] = []

    def fire(body: dict[str, Any], label: str) -> None:
        t = threading.Thread(target=_complete, args=(client, body, results, label), daemon=True)
        t.start()
        threads.append(t)

    started = time.time()
    t0 = time.monotonic()
    # The runaway: EOS ignored and as many tokens as the context allows, so only the ledger's token cap
    # (or its loop rule) stops it.
    runaway = {
        "model": args.model,
        "prompt": _prompt(rng, RUNAWAY_PROMPT),
        "ignore_eos": True,
        "temperature": 0,
    }
    fire({**runaway, "max_tokens": args.runaway_max_tokens}, "runaway")
    # The arrivals are fixed in advance (seeded): shorts at Poisson times over the phase, the long prompt
    # at long_at. Each is sent at its time, or at once when the driver is late (a stalled host once
    # held this loop for 13 s): a late scene is still the whole scene.
    plan: list[tuple[float, str, int]] = []
    t = rng.expovariate(args.short_rps)
    while t < args.duration:
        plan.append((t, "short", rng.randint(*SHORT_PROMPT)))
        t += rng.expovariate(args.short_rps)
    plan.append((args.long_at_s, "long", args.long_tokens))
    plan.append((args.long_at_s - WITNESS_LEAD_S, "witness", WITNESS_PROMPT))
    plan.sort()
    long_sent_ts = None
    for at, label, n in plan:
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        max_tokens = {"long": LONG_OUTPUT, "witness": WITNESS_OUTPUT}.get(label, SHORT_OUTPUT)
        body = {"model": args.model, "prompt": _prompt(rng, n), "max_tokens": max_tokens, "temperature": 0}
        if label == "witness":
            body["ignore_eos"] = True
        fire(body, label)
        if label == "long":
            long_sent_ts = time.time()
    time.sleep(max(0.0, args.duration - (time.monotonic() - t0)))
    sent_long = long_sent_ts is not None
    for t in threads:
        t.join(args.drain_s)
    ended = time.time()
    client.close()
    shorts = [r for r in results if r["label"] == "short"]
    errors = [r for r in results if r.get("error") or r.get("status", 200) >= 400]
    phase = {
        "phase": args.phase,
        "settings": args.settings,
        "engine_source_id": args.engine_source,
        "since": started,
        "until": ended,
        "long_sent_ts": long_sent_ts,
        "sent": {"short": len(shorts), "long": int(sent_long), "runaway": 1},
        "client_errors": len(errors),
        "client_short_ttft_p99_s": _p([r["client_ttft_s"] for r in shorts if r.get("client_ttft_s")], 0.99),
    }
    out = Path(args.out)
    phases = json.loads(out.read_text()) if out.exists() else []
    phases = [p for p in phases if p["phase"] != args.phase] + [phase]
    out.write_text(json.dumps(phases, indent=1))
    print(
        f"phase {args.phase}: {len(shorts)} short requests, 1 long ({args.long_tokens} tokens), 1 runaway "
        f"in {ended - started:.0f} s; {len(errors)} client errors"
    )


def _p(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def size(args: argparse.Namespace) -> None:
    """Profile the engine in this process and print the scene's size as JSON (ledger.advice.scene)."""
    import logging
    import os

    from engine_hooks.vllm.tiny_model import vllm_env

    os.environ.update(vllm_env(args.workdir))
    os.environ.pop("CHUNKLEDGER_URL", None)
    logging.disable(logging.WARNING)
    from engine_hooks.vllm.profile import run_profile
    from ledger.advice.profile import ProfileResult
    from ledger.advice.scene import SIZING_PLAN, size_from_profile
    from ledger.records import as_json

    t0 = time.monotonic()
    run = run_profile(args.model, SIZING_PLAN, kv_cache_bytes=256 << 20)
    scene = size_from_profile(
        ProfileResult.of(SIZING_PLAN, run),
        short_prompt=sum(SHORT_PROMPT) // 2,
        short_output=SHORT_OUTPUT,
        long_prefill_s=args.long_prefill_s,
        max_long_tokens=args.max_long_tokens,
    ).size
    print(scene.describe().replace("\n", "\n# "), file=sys.stderr)
    print(json.dumps({**as_json(scene), "profile_s": round(time.monotonic() - t0, 1)}))


def _ledger(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=60.0)


def advise(args: argparse.Namespace) -> None:
    """Print the advised settings as JSON: for the first ITL target (in the order given) the ledger can
    advise for from the earlier phases' steps; or the refusals and the fallback used."""
    refusals = []
    with _ledger(args.ledger) as c:
        for target in (float(t) for t in args.itl_targets_ms.split(",")):
            r = c.get(
                "/v1/advice/chunk-size",
                params={"itl_target_ms": target, "model": args.model, "since": args.since},
            )
            if r.status_code == 200 and r.json()["settings"]["max_num_batched_tokens"] < args.min_budget:
                budget = r.json()["settings"]["max_num_batched_tokens"]
                refusals.append(f"{target:g} ms: budget {budget} is below max_num_seqs ({args.min_budget})")
            elif r.status_code == 200:
                a = r.json()
                s = a["settings"]
                print(
                    json.dumps(
                        {
                            "max_num_batched_tokens": s["max_num_batched_tokens"],
                            "long_prefill_token_threshold": s["long_prefill_token_threshold"],
                            "itl_target_ms": target,
                            "predicted_itl_p99_ms": round(a["predicted"]["itl_p99_ms"], 1),
                            "fit_r2": round(a["fit"]["r2"], 3),
                            "steps": a["fit"]["steps_used"],
                            "source": "advice",
                        }
                    )
                )
                return
            try:
                refusals.append(f"{target:g} ms: {r.json().get('detail', r.text)}")
            except ValueError:
                refusals.append(f"{target:g} ms: {r.status_code} {r.text[:200]}")
    out = {
        "max_num_batched_tokens": args.fallback_budget,
        "long_prefill_token_threshold": args.fallback_threshold,
        "source": "fallback, no advice: " + " | ".join(refusals),
    }
    print(json.dumps(out))


def _phase_figures(c: httpx.Client, p: dict[str, Any]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    offset = 0
    while True:
        page = c.get(
            "/v1/requests",
            params={"source_id": p["engine_source_id"], "limit": 1000, "offset": offset, "sort": "start_ts"},
        ).json()
        rows += page["rows"]
        offset += 1000
        if offset >= page["total"]:
            break
    shorts = [r for r in rows if SHORT_PROMPT[0] <= (r["prompt_tokens"] or 0) <= SHORT_MAX_PROMPT]
    witness = next((r for r in rows if r["prompt_tokens"] == WITNESS_PROMPT), None)
    witness_itl = None
    if witness is not None:
        witness_itl = c.get(f"/v1/requests/{witness['request_id']}/itl").json().get("max")
    longs = [r for r in rows if (r["prompt_tokens"] or 0) > SHORT_MAX_PROMPT]
    runaway = [r for r in rows if r["prompt_tokens"] == RUNAWAY_PROMPT]
    ttft = [r["ttft_s"] for r in shorts if r["ttft_s"] is not None]
    # the phase's own baseline: the shorts that arrived (and got their first token) before the long one
    long_ts = p.get("long_sent_ts") or float("inf")
    before = [
        r["ttft_s"]
        for r in shorts
        if r["ttft_s"] is not None and r["start_ts"] is not None and r["start_ts"] + r["ttft_s"] < long_ts
    ]
    bw = [r["backend_wait_ttft_s"] for r in shorts if r["backend_wait_ttft_s"] is not None]
    itl = c.get("/v1/itl", params={"since": p["since"], "until": p["until"] + 60}).json()["itl"]
    slowest = max(shorts, key=lambda r: r["ttft_s"] or 0, default=None)
    culprit = None
    if slowest is not None:
        # The biggest delay of the slowest short request that the ledger pins on a long prompt.
        why = c.get(f"/v1/requests/{slowest['request_id']}/why").json()
        long_ids = {lr["request_id"] for lr in longs}
        for item in sorted(why["items"], key=lambda i: -(i["seconds"] or 0)):
            named = [cu for cu in item.get("culprits", []) if cu["request_id"] in long_ids]
            if named and (item["seconds"] or 0) >= 0.001:
                culprit = {"kind": item["kind"], "seconds": item["seconds"], **named[0]}
                break
    cuts = []
    for r in runaway:
        for cu in c.get("/v1/cutoffs", params={"request_id": r["request_id"]}).json()["cutoffs"]:
            cuts.append({"rule": cu["rule"], "action": cu["action"], "state": cu["state"]})
    return {
        "shorts": len(shorts),
        "short_ttft_p50_s": _p(ttft, 0.5),
        "short_ttft_p99_s": _p(ttft, 0.99),
        "short_ttft_p99_before_long_s": _p(before, 0.99),
        "shorts_before_long": len(before),
        "short_backend_wait_share": (sum(bw) / sum(ttft)) if ttft and sum(ttft) else None,
        "itl_p99_s": itl[0]["p99"] if itl else None,
        "witness_itl_max_s": witness_itl,
        "slowest_short": slowest["request_id"] if slowest else None,
        "slowest_short_layers": {
            k: slowest[k] for k in ("ttft_s", "entry_s", "admission_s", "backend_wait_ttft_s", "prefill_s")
        }
        if slowest
        else None,
        "culprit": culprit,
        "long_ttft_s": longs[0]["ttft_s"] if longs else None,
        "runaway_output_tokens": runaway[0]["output_tokens"] if runaway else None,
        "runaway_finish": runaway[0]["finish_reason"] if runaway else None,
        "cutoffs": cuts,
    }


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:,.0f} ms" if abs(s) >= 0.01 else f"{s * 1e3:.1f} ms"


def report(args: argparse.Namespace) -> int:
    phases = json.loads(Path(args.phases).read_text())
    with _ledger(args.ledger) as c:
        figures = [(p, _phase_figures(c, p)) for p in phases]
    print()
    print(
        f"{'phase':<34}{'short TTFT p50':>16}{'short TTFT p99':>16}{'p99 before long':>17}"
        f"{'backend wait':>14}{'ITL p99':>11}{'decode gap':>12}{'long TTFT':>11}  cutoff"
    )
    for p, f in figures:
        share = "-" if f["short_backend_wait_share"] is None else f"{f['short_backend_wait_share']:.0%}"
        cut = ", ".join(f"{x['rule']}→{x['action']} ({x['state']})" for x in f["cutoffs"]) or "none"
        print(
            f"{p['phase'] + ' (' + p['settings'] + ')':<34}{_ms(f['short_ttft_p50_s']):>16}"
            f"{_ms(f['short_ttft_p99_s']):>16}{_ms(f['short_ttft_p99_before_long_s']):>17}"
            f"{share:>14}{_ms(f['itl_p99_s']):>11}{_ms(f['witness_itl_max_s']):>12}"
            f"{_ms(f['long_ttft_s']):>11}  {cut}"
        )
    print()
    for line in story(figures):
        print(line)
    print()
    for p, f in figures:
        lay = f["slowest_short_layers"]
        if lay and lay["ttft_s"] is not None:
            print(
                f"{p['phase']}: slowest short request {f['slowest_short']}: TTFT {_ms(lay['ttft_s'])} "
                f"= entry {_ms(lay['entry_s'])} + admission {_ms(lay['admission_s'])} + backend wait "
                f"{_ms(lay['backend_wait_ttft_s'])} + prefill {_ms(lay['prefill_s'])}"
            )
        cu = f["culprit"]
        if cu:
            print(
                f"   why: {_ms(cu['seconds'])} in {cu['kind'].replace('_', ' ')} behind the long prompt "
                f"{cu['request_id']} ({cu['prompt_tokens'] or 0:,} prompt tokens, prefilled in "
                f"{cu['request_chunks'] or 0} chunks; {cu['prefill_tokens']:,} of them in "
                f"{cu['chunks']} chunk{'s' if cu['chunks'] != 1 else ''} during this wait)"
            )
        if f["runaway_output_tokens"] is not None:
            print(
                f"   runaway request stopped after {f['runaway_output_tokens']:,} tokens "
                f"(finish {f['runaway_finish']})"
            )
    Path(args.phases).with_suffix(".report.json").write_text(
        json.dumps([{**p, **f} for p, f in figures], indent=1)
    )
    if args.check:
        return check(figures)
    return 0


def story(figures: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[str]:
    """The seed's story in the phases' own figures (A no chunking, B chunking alone, C advised)."""
    f = {p["phase"]: (p, x) for p, x in figures}
    lines = []
    labels = {
        "A": "no chunking: the long prompt's one prefill step holds every arrival",
        "B": "chunking alone: running decodes keep their ITL, arrivals still wait behind the chunks",
        "C": "the ledger's advice + the admission reserve: arrivals run beside the long prompt",
    }
    for name in sorted(f):
        p, x = f[name]
        if x["short_ttft_p99_s"] is None:
            continue
        lines.append(
            f"{name}, {labels.get(name, p['settings'])}: short TTFT p99 {_ms(x['short_ttft_p99_s'])} "
            f"(before the long prompt {_ms(x['short_ttft_p99_before_long_s'])}), decode ITL p99 "
            f"{_ms(x['itl_p99_s'])}, a decode running when it came waited {_ms(x['witness_itl_max_s'])} "
            f"for one token, long TTFT {_ms(x['long_ttft_s'])}"
        )
    return lines


def check(figures: list[tuple[dict[str, Any], dict[str, Any]]]) -> int:
    """The shape the demo must reproduce: the long prompt inflates short TTFT without chunking, chunking
    alone barely helps it, the advised settings bring it down; the runaway is cut in every phase."""
    f = {p["phase"]: x for p, x in figures}
    problems = []
    if len(f) != 3:
        problems.append(f"expected 3 phases, got {sorted(f)}")
    else:
        a, b, c = (f[k]["short_ttft_p99_s"] for k in sorted(f))
        if None in (a, b, c):
            problems.append("a phase has no short-request TTFT")
        elif not (c < a and c < b / 2):
            # vs chunking alone the gap is wide; vs no chunking it depends on how long the tiny model's
            # unchunked prefill takes on the machine (0.3 s for 6k tokens on a quiet one)
            problems.append(
                f"advised short TTFT p99 {c:.3f}s is not below unchunked {a:.3f}s "
                f"and half of chunked {b:.3f}s"
            )
        elif a < 1.0:
            problems.append(
                f"unchunked short TTFT p99 {a:.3f}s: the long prompt did not hold arrivals for seconds"
            )
        elif not c < a / 3:
            problems.append(f"advised short TTFT p99 {c:.3f}s is not under a third of unchunked {a:.3f}s")
        # chunking protects running decodes: the decode running when the long prompt came waits for
        # one chunk's step, not the whole prefill (checked when the unchunked prefill did hit it)
        wa, wb = (f[k]["witness_itl_max_s"] for k in sorted(f)[:2])
        if wa is not None and wb is not None and wa > 1.0 and not wb < wa / 3:
            problems.append(
                f"chunking alone did not protect the running decode: its largest gap {wb:.3f}s against "
                f"{wa:.3f}s unchunked"
            )
        cu = f[sorted(f)[1]]["culprit"]
        if not cu:
            problems.append(
                "the ledger did not name the long prompt behind the slowest short request (chunked)"
            )
        elif not ((cu.get("prompt_tokens") or 0) > SHORT_MAX_PROMPT and (cu.get("request_chunks") or 0) > 1):
            problems.append(f"the long prompt is named without its real length and chunks: {cu}")
    for name, x in f.items():
        if not x["cutoffs"]:
            problems.append(f"phase {name}: no cutoff for the runaway request")
    for msg in problems:
        print(f"CHECK FAILED: {msg}", file=sys.stderr)
    if not problems:
        print("check: the comparison has the expected shape")
    return 1 if problems else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--phase", required=True)
    r.add_argument("--settings", default="")
    r.add_argument("--gateway", required=True)
    r.add_argument("--engine-source", required=True)
    r.add_argument("--model", default="tiny")
    r.add_argument("--duration", type=float, default=30.0)
    r.add_argument("--short-rps", type=float, default=4.0)
    r.add_argument("--long-tokens", type=int, default=20000)
    r.add_argument("--long-at-s", type=float, default=3.0)
    r.add_argument("--drain-s", type=float, default=120.0)
    r.add_argument("--runaway-max-tokens", type=int, default=8000)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", required=True)
    z = sub.add_parser("size")
    z.add_argument("--model", required=True)
    z.add_argument("--workdir", required=True, help="vLLM's runtime folder (short path: its sockets)")
    z.add_argument("--long-prefill-s", type=float, default=3.0)
    z.add_argument("--max-long-tokens", type=int, default=24000)
    a = sub.add_parser("advise")
    a.add_argument("--ledger", required=True)
    a.add_argument("--model", default="tiny")
    a.add_argument("--since", required=True, help="unix seconds: the start of the demo's first phase")
    a.add_argument("--itl-targets-ms", default="50,100,200,400", help="tried in order")
    a.add_argument(
        "--min-budget", type=int, default=64, help="vLLM's max_num_seqs: a smaller budget cannot run"
    )
    a.add_argument("--fallback-budget", type=int, default=512)
    a.add_argument("--fallback-threshold", type=int, default=256)
    p = sub.add_parser("report")
    p.add_argument("--ledger", required=True)
    p.add_argument("--phases", required=True)
    p.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.cmd == "run":
        run_phase(args)
        return 0
    if args.cmd == "size":
        size(args)
        return 0
    if args.cmd == "advise":
        advise(args)
        return 0
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
