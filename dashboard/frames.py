"""API answers into pandas frames (and the names of what they hold), so that pages only lay things out.

Pure functions of what :class:`dashboard.data.LedgerData` returned, apart from :func:`data_span`, which
asks it for the window's first and last request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from dashboard.data import LedgerData
    from ledger.whatif.answer import CalibrationError, Candidate, Relative, ReplayTails, WhatIf

LAYERS = ("entry_s", "admission_s", "frontend_s", "engine_queue_s", "prefill_s", "decode_s")
LAYER_NAMES = {
    "entry_s": "entry",
    "admission_s": "admission",
    "frontend_s": "engine front end",
    "engine_queue_s": "engine queue",
    "prefill_s": "prefill",
    "decode_s": "decode",
}
TAILS = ("p50", "p90", "p99")
# The latencies a user picks from on the overview and the requests table, with their labels.
LATENCIES = {
    "client_ttft_s": "TTFT at the client",
    "ttft_s": "TTFT (engine)",
    "e2e_s": "end to end",
    "engine_queue_s": "engine queue",
    "frontend_s": "engine front end",
    "delivery_s": "first token delivery",
    "backend_wait_s": "backend wait",
    "prefill_s": "prefill",
    "decode_s": "decode",
    "admission_s": "admission",
    "entry_s": "entry",
    "kv_idle_s": "KV idle",
}


def bucket_for(span_s: float, target_buckets: int = 40) -> float:
    """A round bucket width giving at most ``target_buckets`` buckets over ``span_s`` (1 s .. 1 day)."""
    for b in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400):
        if span_s / b <= target_buckets:
            return float(b)
    return 86400.0


def data_span(data: LedgerData, since: str | None, since_s: float | None, now: float) -> tuple[float, float]:
    """(first, last) end of a finished request in the window, at least 10 s apart and ending no earlier
    than now: buckets follow the data, so a young ledger is not drawn as one point."""
    first = data.requests(since=since, live=False, sort="end_ts", order="asc", limit=1)["rows"]
    last = data.requests(since=since, live=False, sort="end_ts", order="desc", limit=1)["rows"]
    if not first or first[0].get("end_ts") is None:
        return (since_s if since_s else now - 3600.0), now
    lo = float(first[0]["end_ts"])
    hi = max(now, float(last[0].get("end_ts") or now)) if last else now
    return min(lo, hi - 10.0), hi


def tails_long(groups: list[dict[str, Any]], metrics: Iterable[str]) -> pd.DataFrame:
    """Bucketed attribution -> one row per (bucket, metric, tail) with the value in milliseconds."""
    rows = []
    for g in groups:
        for m in metrics:
            s = g["layers"].get(m) or {}
            if not s.get("n"):
                continue
            for t in (*TAILS, "max"):
                if s.get(t) is not None:
                    rows.append(
                        {
                            "time": pd.to_datetime(g["bucket_ts"], unit="s", utc=True),
                            "bucket_ts": g["bucket_ts"],
                            "metric": m,
                            "latency": LATENCIES.get(m, m),
                            "tail": t,
                            "ms": s[t] * 1e3,
                            "n": s["n"],
                        }
                    )
    return pd.DataFrame(rows, columns=["time", "bucket_ts", "metric", "latency", "tail", "ms", "n"])


def layers_long(groups: list[dict[str, Any]]) -> pd.DataFrame:
    """Bucketed attribution -> per (bucket, layer): mean and p99 in ms, and the mean's share of e2e."""
    rows = []
    for g in groups:
        means = {m: (g["layers"].get(m) or {}).get("mean") for m in LAYERS}
        total = sum(v for v in means.values() if v)
        for m in LAYERS:
            s = g["layers"].get(m) or {}
            if s.get("mean") is None:
                continue
            rows.append(
                {
                    "time": pd.to_datetime(g["bucket_ts"], unit="s", utc=True),
                    "layer": LAYER_NAMES[m],
                    "order": LAYERS.index(m),
                    "mean_ms": s["mean"] * 1e3,
                    "p50_ms": (s.get("p50") or 0.0) * 1e3,
                    "p99_ms": (s.get("p99") or 0.0) * 1e3,
                    "share": (s["mean"] / total) if total else 0.0,
                }
            )
    cols = ["time", "layer", "order", "mean_ms", "p50_ms", "p99_ms", "share"]
    return pd.DataFrame(rows, columns=cols)


def throughput(groups: list[dict[str, Any]], bucket_s: float) -> pd.DataFrame:
    """Finished requests per second, output tokens per second and preemptions (of the requests that
    finished in it), per bucket; ``time`` .. ``time_end`` is the bucket."""
    rows = [
        {
            "time": pd.to_datetime(g["bucket_ts"], unit="s", utc=True),
            "time_end": pd.to_datetime(g["bucket_ts"] + bucket_s, unit="s", utc=True),
            "bucket_ts": float(g["bucket_ts"]),
            "requests": int(g["requests"]),
            "requests_per_s": g["requests"] / bucket_s,
            "output_tokens_per_s": (g.get("output_tokens") or 0) / bucket_s,
            "preemptions": int(g.get("preemptions") or 0),
        }
        for g in groups
    ]
    cols = [
        "time",
        "time_end",
        "bucket_ts",
        "requests",
        "requests_per_s",
        "output_tokens_per_s",
        "preemptions",
    ]
    return pd.DataFrame(rows, columns=cols)


def bucket_domain(lo: float, hi: float, bucket_s: float) -> tuple[float, float]:
    """The x extent of time-bucketed bars over the data span ``lo``..``hi``: whole buckets."""
    start = math.floor(lo / bucket_s) * bucket_s
    end = max(start + bucket_s, math.ceil(hi / bucket_s) * bucket_s)
    return start, end


def timeline(
    request: dict[str, Any], events: list[dict[str, Any]], why: dict[str, Any] | None
) -> pd.DataFrame:
    """A request's life as Gantt bars: (lane, what, start, end, label), times in seconds since arrival.

    Lanes: "layers" (entry, admission, engine front end, engine queue, prefill, decode as cut by the
    ledger), "client" (from the first token written to the client to the last), "engine"
    (each prefill chunk at its step, each preemption -> resume wait, output token groups), and "sat out"
    (steps it held KV without progress, from the why list), plus point marks for cutoffs.
    """
    t0 = request.get("start_ts") or request.get("arrived_ts") or request.get("queued_ts")
    if t0 is None and events:
        t0 = min(e["ts"] for e in events)
    if t0 is None:
        return pd.DataFrame(columns=["lane", "what", "start_s", "end_s", "label"])
    bars: list[dict[str, Any]] = []

    def bar(lane: str, what: str, a: float | None, b: float | None, label: str = "") -> None:
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            return
        bars.append({"lane": lane, "what": what, "start_s": a - t0, "end_s": max(b, a) - t0, "label": label})

    r = request
    arrival = r.get("arrived_ts") or r.get("engine_arrival_ts") or r.get("queued_ts")
    enq = r.get("admission_enqueued_ts") or r.get("queued_ts")
    fwd = r.get("admitted_ts") or enq
    end = r.get("end_ts") or r.get("last_event_ts")
    bar("layers", "entry", arrival, enq, f"{(r.get('entry_s') or 0) * 1e3:.1f} ms")
    if r.get("admitted_ts"):
        bar("layers", "admission", enq, fwd, f"{(r.get('admission_s') or 0) * 1e3:.1f} ms")
    queued = r.get("queued_ts")
    sched = r.get("first_scheduled_ts") or end
    if queued is not None and fwd is not None and sched is not None:
        queued = min(max(queued, fwd), sched)
        bar("layers", "engine front end", fwd, queued, f"{(r.get('frontend_s') or 0) * 1e3:.1f} ms")
        bar("layers", "engine queue", queued, sched, "until first scheduled")
    else:
        bar("layers", "engine queue", fwd, sched, "until first scheduled")
    bar(
        "layers",
        "prefill",
        r.get("first_scheduled_ts"),
        r.get("first_token_ts") or end,
        "first chunk -> first token",
    )
    bar("layers", "decode", r.get("first_token_ts"), end, f"{r.get('output_tokens') or 0} tokens")
    out_first = r.get("first_token_out_ts")
    if out_first is not None:
        ttft = r.get("client_ttft_s")
        label = f"TTFT at the client {ttft * 1e3:.1f} ms" if ttft is not None else "first token out"
        bar("client", "delivered", out_first, r.get("last_token_out_ts") or out_first, label)
    preempted_at: float | None = None
    for e in events:
        kind = e.get("kind")
        if kind == "chunk":
            dur = 0.0
            bar(
                "engine",
                "chunk",
                e["ts"],
                e["ts"] + dur,
                f"step {e.get('step')}: {e.get('tokens')} tokens at depth {e.get('computed_before')}",
            )
        elif kind == "preempted":
            preempted_at = e["ts"]
        elif kind == "resumed" and preempted_at is not None:
            bar("engine", "preempted", preempted_at, e["ts"], f"waited {e.get('wait_s', 0):.3f} s")
            preempted_at = None
        elif kind == "tokens":
            first = e.get("first_ts") or e["ts"]
            bar("engine", "tokens", first, e["ts"], f"{e.get('count')} tokens (total {e.get('total')})")
        elif kind in ("cutoff_applied", "stream_cut"):
            bar("cutoff", "cutoff", e["ts"], e["ts"], f"{e.get('rule')} ({e.get('action', 'cut')})")
        elif kind == "admission_enqueued":
            pass
    if preempted_at is not None:
        bar("engine", "preempted", preempted_at, end or preempted_at, "still waiting")
    for item in (why or {}).get("items", []):
        if item.get("kind") == "sat_out" and item.get("start_ts") is not None:
            bar(
                "sat out",
                "sat out",
                item["start_ts"],
                item["start_ts"] + item["seconds"],
                item.get("detail", ""),
            )
    return pd.DataFrame(bars, columns=["lane", "what", "start_s", "end_s", "label"])


# Setting names as chart labels: vLLM's names do not fit an axis.
SHORT_SETTINGS = {
    "max_num_batched_tokens": "budget",
    "long_prefill_token_threshold": "threshold",
    "enable_chunked_prefill": "chunked",
    "admission_reserve": "reserve",
    "admission_aging_s": "aging",
    "max_num_seqs": "seqs",
    "num_kv_blocks": "KV blocks",
    "block_size": "block",
    "reserve_full_isl": "full ISL",
    "policy": "policy",
}


def short_setting(name: str) -> str:
    """``max_num_batched_tokens=512,policy=kv-idle`` -> ``budget 512, policy kv-idle``."""
    parts = []
    for part in name.split(","):
        key, eq, value = part.partition("=")
        parts.append(f"{SHORT_SETTINGS.get(key, key)} {value}" if eq else part)
    return ", ".join(parts)


def whatif_rows(answer: WhatIf) -> pd.DataFrame:
    """``GET /v1/whatif``'s answer as one row per setting: measured, the recorded setting replayed,
    then each asked one (milliseconds; the change from the recorded setting replayed)."""
    cal = answer.calibration
    rows: list[tuple[str, str, ReplayTails, Relative | CalibrationError | None, Candidate | None]] = [
        ("measured", "measured", cal.measured, None, None),
        ("recorded (replayed)", "replayed", cal.predicted, cal.error, None),
    ]
    rows += [(c.name, "predicted", c.predicted, c.relative, c) for c in answer.candidates]
    out = []
    for name, kind, tails, rel, candidate in rows:
        label = name if kind != "predicted" else short_setting(name)
        row: dict[str, Any] = {"setting": name, "label": label, "kind": kind}
        for key in ("short_ttft_p99_s", "long_ttft_max_s", "ttft_p50_s", "itl_p99_s", "e2e_p99_s"):
            v = getattr(tails, key)
            row[key[:-2] + "_ms"] = None if v is None else v * 1e3
        row["preemptions"] = tails.preemptions
        row["change_short_ttft"] = getattr(rel, "short_ttft_p99_s", None)
        row["frontier"] = None if candidate is None else candidate.frontier
        row["best"] = None if candidate is None else candidate.best
        out.append(row)
    return pd.DataFrame(out)
