"""The fleet's engines as frames for the charts: by model, and the engines that are worst right now
(``GET /v1/engines``). Hundreds of engines are never a legend entry each: a chart draws the models, or
the ``top`` worst engines (and the ones the user picks) with the rest of each model as one line."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from ledger.analytics.answers import EngineLoad

if TYPE_CHECKING:
    from dashboard.data import LedgerData

TOP = 8  # the worst engines drawn on their own by default
MAX_PICKED = 12  # engines a user may add to them
RANK_BY = {"kv_usage": "KV cache in use", "waiting": "requests waiting", "step_s": "mean step time"}

POINT_COLUMNS = [
    "time",
    "series",
    "label",
    "kind",
    "model",
    "engines",
    "kv_pct_max",
    "kv_pct_mean",
    "waiting_max",
    "waiting_mean",
    "step_ms_mean",
    "step_ms_max",
]


def points(load: EngineLoad) -> pd.DataFrame:
    """One row per (bucket, series); ``label`` names it as a legend does: the model, the engine, or
    "<model>: the other N" for the engines of a model not drawn on their own."""
    rows = [
        {
            "time": pd.to_datetime(p.bucket_ts, unit="s", utc=True),
            "series": p.series,
            "label": _label(p.kind, p.series, p.engines),
            "kind": p.kind,
            "model": p.model or "(no model)",
            "engines": p.engines,
            "kv_pct_max": p.kv_usage_max * 100,
            "kv_pct_mean": p.kv_usage_mean * 100,
            "waiting_max": p.waiting_max,
            "waiting_mean": p.waiting_mean,
            "step_ms_mean": p.step_s_mean * 1e3,
            "step_ms_max": p.step_s_max * 1e3,
        }
        for p in load.points
    ]
    df = pd.DataFrame(rows, columns=POINT_COLUMNS)
    if df.empty:
        return df
    # A rest series is labelled by its most engines, so that its legend entry stays one line.
    rest = df["kind"] == "rest"
    most = df[rest].groupby("series")["engines"].transform("max")
    df.loc[rest, "label"] = df.loc[rest, "series"] + ": the other " + most.astype(str)
    return df


def _label(kind: str, series: str, engines: int) -> str:
    return f"{series}: the other {engines}" if kind == "rest" else series


def ranking(load: EngineLoad) -> pd.DataFrame:
    """Every engine, worst first, as its newest bucket saw it."""
    return pd.DataFrame(
        [
            {
                "rank": e.rank,
                "engine": e.source_id,
                "model": e.model,
                "KV in use (%)": e.kv_usage * 100,
                "waiting": e.waiting,
                "running": e.running,
                "step (ms)": e.step_s * 1e3,
                "drawn": e.shown,
            }
            for e in load.engines
        ]
    )


def models_now(load: EngineLoad) -> pd.DataFrame:
    """Per model, its newest bucket: engines, KV in use (mean, max), waiting (max), mean step time."""
    df = points(load)
    if df.empty:
        return df
    df = df[df["kind"] == "model"]
    last = df.sort_values("time").groupby("series").tail(1)
    return pd.DataFrame(
        {
            "model": last["series"],
            "engines": last["engines"],
            "KV in use, mean (%)": last["kv_pct_mean"],
            "KV in use, max (%)": last["kv_pct_max"],
            "waiting, max": last["waiting_max"],
            "step (ms)": last["step_ms_mean"],
        }
    ).reset_index(drop=True)


def span_s(data: LedgerData, since_s: float | None, now: float) -> float:
    """Seconds a window spans: back to its start, or (all time) to the first engine's first event."""
    if since_s:
        return now - since_s
    first = [float(s["first_seen_ts"]) for s in data.sources() if s.get("kind") == "engine"]
    return max(now - min(first), 60.0) if first else 3600.0
