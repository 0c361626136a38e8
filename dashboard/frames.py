"""API answers into pandas frames (and the names of what they hold), so that pages only lay things out.

Pure functions of what :class:`dashboard.data.LedgerData` returned, apart from :func:`data_span`, which
asks it for the window's first and last request.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

import pandas as pd

from ledger.analytics.answers import AttributionGroup, Tails
from ledger.analytics.why_answer import Why
from ledger.records import UnsetType

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


def bucket_start(group: AttributionGroup) -> float:
    """A bucketed attribution group's start (unix seconds): every group has one when asked with bucket_s."""
    if isinstance(group.bucket_ts, UnsetType):
        raise ValueError("an attribution group without bucket_ts: ask for it with bucket_s")
    return group.bucket_ts


def layer_tails(group: AttributionGroup, metric: str) -> Tails:
    """The group's tails of one latency of ``ledger.analytics.answers.METRICS``."""
    tails: Tails = getattr(group.layers, metric)
    return tails


def tails_long(groups: Iterable[AttributionGroup], metrics: Iterable[str]) -> pd.DataFrame:
    """Bucketed attribution -> one row per (bucket, metric, tail) with the value in milliseconds."""
    rows = []
    metrics = list(metrics)
    for g in groups:
        ts = bucket_start(g)
        for m in metrics:
            s = layer_tails(g, m)
            if not s.n:
                continue
            for t in (*TAILS, "max"):
                v = getattr(s, t)
                if v is not None:
                    rows.append(
                        {
                            "time": pd.to_datetime(ts, unit="s", utc=True),
                            "bucket_ts": ts,
                            "metric": m,
                            "latency": LATENCIES.get(m, m),
                            "tail": t,
                            "ms": v * 1e3,
                            "n": s.n,
                        }
                    )
    return pd.DataFrame(rows, columns=["time", "bucket_ts", "metric", "latency", "tail", "ms", "n"])


def layers_long(groups: Iterable[AttributionGroup]) -> pd.DataFrame:
    """Bucketed attribution -> per (bucket, layer): mean and p99 in ms, and the mean's share of e2e."""
    rows = []
    for g in groups:
        means = {m: layer_tails(g, m).mean for m in LAYERS}
        total = sum(v for v in means.values() if v)
        for m in LAYERS:
            s = layer_tails(g, m)
            if s.mean is None:
                continue
            rows.append(
                {
                    "time": pd.to_datetime(bucket_start(g), unit="s", utc=True),
                    "layer": LAYER_NAMES[m],
                    "order": LAYERS.index(m),
                    "mean_ms": s.mean * 1e3,
                    "p50_ms": (s.p50 or 0.0) * 1e3,
                    "p99_ms": (s.p99 or 0.0) * 1e3,
                    "share": (s.mean / total) if total else 0.0,
                }
            )
    cols = ["time", "layer", "order", "mean_ms", "p50_ms", "p99_ms", "share"]
    return pd.DataFrame(rows, columns=cols)


def throughput(groups: Iterable[AttributionGroup], bucket_s: float) -> pd.DataFrame:
    """Finished requests per second, output tokens per second and preemptions (of the requests that
    finished in it), per bucket; ``time`` .. ``time_end`` is the bucket."""
    rows = [
        {
            "time": pd.to_datetime(bucket_start(g), unit="s", utc=True),
            "time_end": pd.to_datetime(bucket_start(g) + bucket_s, unit="s", utc=True),
            "bucket_ts": bucket_start(g),
            "requests": g.requests,
            "requests_per_s": g.requests / bucket_s,
            "output_tokens_per_s": g.output_tokens / bucket_s,
            "preemptions": g.preemptions,
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


BAR_COLUMNS = ["lane", "what", "start_s", "end_s", "label"]


class Bar(NamedTuple):
    """One bar of a request's timeline, in seconds since its arrival."""

    lane: str
    what: str
    start_s: float
    end_s: float
    label: str


def arrival(request: dict[str, Any], events: list[dict[str, Any]]) -> float | None:
    """Time 0 of a request's timeline: its start, else its first event (``events`` oldest first)."""
    t0: float | None = request.get("start_ts") or request.get("arrived_ts") or request.get("queued_ts")
    if t0 is None and events:
        t0 = min(e["ts"] for e in events)
    return t0


def _ms(seconds: float | None) -> str:
    return f"{(seconds or 0) * 1e3:.1f} ms"


class _Timeline:
    """The bars of one request (its ``requests`` row and its events, as the API answers them) as they
    are drawn: unix seconds become seconds since ``t0``; a bar with an end missing or not finite is
    left out, and one that ends before it starts is a mark at its start."""

    def __init__(self, request: dict[str, Any], events: list[dict[str, Any]], t0: float) -> None:
        self.r = request
        self.events = events
        self.t0 = t0
        self.end: float | None = request.get("end_ts") or request.get("last_event_ts")
        self.bars: list[Bar] = []

    def add(self, lane: str, what: str, a: float | None, b: float | None, label: str = "") -> None:
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            return
        self.bars.append(Bar(lane, what, a - self.t0, max(b, a) - self.t0, label))

    def layers(self) -> None:
        """The "layers" lane as the ledger cut the request, and the "client" lane (first to last token
        written to the client)."""
        r, end = self.r, self.end
        arrived = r.get("arrived_ts") or r.get("engine_arrival_ts") or r.get("queued_ts")
        enq = r.get("admission_enqueued_ts") or r.get("queued_ts")
        fwd = r.get("admitted_ts") or enq
        self.add("layers", "entry", arrived, enq, _ms(r.get("entry_s")))
        if r.get("admitted_ts"):
            self.add("layers", "admission", enq, fwd, _ms(r.get("admission_s")))
        queued = r.get("queued_ts")
        sched = r.get("first_scheduled_ts") or end
        if queued is not None and fwd is not None and sched is not None:
            queued = min(max(queued, fwd), sched)
            self.add("layers", "engine front end", fwd, queued, _ms(r.get("frontend_s")))
            self.add("layers", "engine queue", queued, sched, "until first scheduled")
        else:
            self.add("layers", "engine queue", fwd, sched, "until first scheduled")
        first_token = r.get("first_token_ts")
        self.add(
            "layers", "prefill", r.get("first_scheduled_ts"), first_token or end, "first chunk -> first token"
        )
        self.add("layers", "decode", first_token, end, f"{r.get('output_tokens') or 0} tokens")
        out_first = r.get("first_token_out_ts")
        if out_first is not None:
            ttft = r.get("client_ttft_s")
            label = f"TTFT at the client {ttft * 1e3:.1f} ms" if ttft is not None else "first token out"
            self.add("client", "delivered", out_first, r.get("last_token_out_ts") or out_first, label)

    def engine(self) -> None:
        """The "engine" lane (each prefill chunk at its step, each preemption -> resume wait, output
        token groups) and the cutoff marks, from the request's events."""
        preempted_at: float | None = None
        for e in self.events:
            kind, ts = e.get("kind"), e["ts"]
            if kind == "chunk":
                label = f"step {e.get('step')}: {e.get('tokens')} tokens at depth {e.get('computed_before')}"
                self.add("engine", "chunk", ts, ts, label)
            elif kind == "preempted":
                preempted_at = ts
            elif kind == "resumed" and preempted_at is not None:
                self.add("engine", "preempted", preempted_at, ts, f"waited {e.get('wait_s', 0):.3f} s")
                preempted_at = None
            elif kind == "tokens":
                label = f"{e.get('count')} tokens (total {e.get('total')})"
                self.add("engine", "tokens", e.get("first_ts") or ts, ts, label)
            elif kind in ("cutoff_applied", "stream_cut"):
                self.add("cutoff", "cutoff", ts, ts, f"{e.get('rule')} ({e.get('action', 'cut')})")
        if preempted_at is not None:
            self.add("engine", "preempted", preempted_at, self.end or preempted_at, "still waiting")

    def sat_out(self, why: Why | None) -> None:
        """The "sat out" lane: the steps the request held KV without progress, from its why list."""
        for item in why.items if why is not None else []:
            if item.kind == "sat_out" and item.start_ts is not None and item.seconds is not None:
                self.add("sat out", "sat out", item.start_ts, item.start_ts + item.seconds, item.detail)


def timeline(request: dict[str, Any], events: list[dict[str, Any]], why: Why | None) -> pd.DataFrame:
    """A request's life as Gantt bars: (lane, what, start, end, label), times in seconds since arrival.

    Lanes: "layers" (entry, admission, engine front end, engine queue, prefill, decode as cut by the
    ledger), "client" (from the first token written to the client to the last), "engine"
    (each prefill chunk at its step, each preemption -> resume wait, output token groups), and "sat out"
    (steps it held KV without progress, from the why list), plus point marks for cutoffs.
    """
    t0 = arrival(request, events)
    if t0 is None:
        return pd.DataFrame(columns=BAR_COLUMNS)
    bars = _Timeline(request, events, t0)
    bars.layers()
    bars.engine()
    bars.sat_out(why)
    return pd.DataFrame(bars.bars, columns=BAR_COLUMNS)


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


class WhatIfRow(NamedTuple):
    """One setting of the what-if table: its tails in milliseconds, and for an asked one the change
    from the recorded setting replayed and whether it is on the frontier, the best."""

    setting: str
    label: str
    kind: str  # measured | replayed | predicted
    short_ttft_p99_ms: float | None
    long_ttft_max_ms: float | None
    ttft_p50_ms: float | None
    itl_p99_ms: float | None
    e2e_p99_ms: float | None
    preemptions: int
    change_short_ttft: float | None
    frontier: bool | None
    best: bool | None


def _ms_or_none(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def whatif_rows(answer: WhatIf) -> pd.DataFrame:
    """``GET /v1/whatif``'s answer as one row per setting: measured, the recorded setting replayed,
    then each asked one (milliseconds; the change from the recorded setting replayed)."""
    cal = answer.calibration
    rows: list[tuple[str, str, ReplayTails, Relative | CalibrationError | None, Candidate | None]] = [
        ("measured", "measured", cal.measured, None, None),
        ("recorded (replayed)", "replayed", cal.predicted, cal.error, None),
    ]
    rows += [(c.name, "predicted", c.predicted, c.relative, c) for c in answer.candidates]
    return pd.DataFrame(
        [
            WhatIfRow(
                setting=name,
                label=name if kind != "predicted" else short_setting(name),
                kind=kind,
                short_ttft_p99_ms=_ms_or_none(tails.short_ttft_p99_s),
                long_ttft_max_ms=_ms_or_none(tails.long_ttft_max_s),
                ttft_p50_ms=_ms_or_none(tails.ttft_p50_s),
                itl_p99_ms=_ms_or_none(tails.itl_p99_s),
                e2e_p99_ms=_ms_or_none(tails.e2e_p99_s),
                preemptions=tails.preemptions,
                change_short_ttft=getattr(rel, "short_ttft_p99_s", None),
                frontier=None if candidate is None else candidate.frontier,
                best=None if candidate is None else candidate.best,
            )
            for name, kind, tails, rel, candidate in rows
        ]
    )
