"""KV & preemption: live stall ranking, KV idle block-seconds, preemptions over time, the engines by
model and the worst right now, escape-valve actions."""

from __future__ import annotations

import time

import altair as alt
import pandas as pd
import streamlit as st

from dashboard import charts, fleet, ui
from dashboard.data import Unavailable
from dashboard.frames import bucket_domain, bucket_for, data_span, throughput
from ledger.client import LedgerError
from ledger.records import as_json

PREEMPTED_ROWS = 50  # the preempted requests listed under the chart, most preempted first


def stall_ranking(ctx: ui.Context) -> None:
    st.subheader("Live: held KV without progress")
    with ui.ledger_errors("KV stalls"):
        doc = ctx.data.kv_stalls(limit=50)
        df = pd.DataFrame(as_json(doc.requests))
        if df.empty:
            st.caption("no live requests right now")
            return
        st.caption(f"live requests ranked by seconds since their last token or step, at {ui.fmt_ts(doc.now)}")
        df.insert(1, "open", "request?id=" + df["request_id"].astype(str))
        st.altair_chart(
            charts.bars(
                df.head(20)[["request_id", "stall_s", "state"]],
                "stall_s",
                "request_id",
                "without progress (s)",
                "request",
                "state",
            )
        )
        st.dataframe(
            df,
            hide_index=True,
            column_config={
                "open": st.column_config.LinkColumn("open", display_text="open"),
                "stall_s": st.column_config.NumberColumn("stalled (s)", format="%.2f"),
                "kv_idle_s": st.column_config.NumberColumn("KV idle (s)", format="%.2f"),
                "kv_idle_block_s": st.column_config.NumberColumn("KV idle (block·s)", format="%.1f"),
            },
        )


def idle_block_seconds(ctx: ui.Context) -> None:
    st.subheader("KV idle block-seconds: who held cache without using it")
    with ui.ledger_errors("requests"):
        out = ctx.data.requests(since=ctx.since, sort="kv_idle_block_s", order="desc", limit=20)
        df = pd.DataFrame(out["rows"])
        if df.empty or not (df["kv_idle_block_s"].fillna(0) > 0).any():
            st.caption("no request held KV blocks idle in this window")
            return
        df = df[df["kv_idle_block_s"].fillna(0) > 0]
        show = df[
            [
                "request_id",
                "kv_idle_block_s",
                "kv_idle_s",
                "stalled_steps",
                "kv_blocks_max",
                "preemptions",
                "prompt_tokens",
            ]
        ]
        st.altair_chart(charts.bars(show, "kv_idle_block_s", "request_id", "KV idle (block·s)", "request"))
        show = show.copy()
        show.insert(1, "open", "request?id=" + show["request_id"].astype(str))
        st.dataframe(
            show,
            hide_index=True,
            column_config={"open": st.column_config.LinkColumn("open", display_text="open")},
        )


def preemption_buckets(ctx: ui.Context, now: float) -> tuple[pd.DataFrame, float, tuple[float, float]]:
    """Preemptions of the requests that finished in the window, per bucket of their end time (the
    ledger's attribution), the bucket width, and the x extent: whole buckets over the data span."""
    lo, hi = data_span(ctx.data, ctx.since, ctx.since_s, now)
    bucket_s = bucket_for(hi - lo)
    groups = ctx.data.attribution(ctx.since, bucket_s=bucket_s).groups
    tp = throughput(groups, bucket_s)
    return tp, bucket_s, bucket_domain(lo, hi, bucket_s)


def preemptions(ctx: ui.Context) -> None:
    st.subheader("Preemptions")
    with ui.ledger_errors("attribution"):
        tp, bucket_s, span = preemption_buckets(ctx, time.time())
        total = int(tp["preemptions"].sum()) if not tp.empty else 0
        if not total:
            st.caption("no preemptions among the requests that finished in this window")
        else:
            st.altair_chart(
                charts.bucket_bars(
                    tp,
                    "preemptions",
                    "preemptions",
                    f"preemptions per {int(bucket_s)} s (finished requests, by end time)",
                    domain=span,
                    color="#d62728",
                    tooltip=[
                        alt.Tooltip("time:T", title="from (UTC)", format="%H:%M:%S"),
                        alt.Tooltip("time_end:T", title="to (UTC)", format="%H:%M:%S"),
                        alt.Tooltip("preemptions:Q", title="preemptions"),
                        alt.Tooltip("requests:Q", title="finished requests"),
                    ],
                )
            )
            st.caption(f"{total:,} preemptions of requests that finished in this window")
        out = ctx.data.requests(
            since=ctx.since, live=False, sort="preemptions", order="desc", limit=PREEMPTED_ROWS
        )
        df = pd.DataFrame(out["rows"])
        if not df.empty and (df["preemptions"].fillna(0) > 0).any():
            df = df[df["preemptions"].fillna(0) > 0][
                ["request_id", "preemptions", "recomputed_tokens", "backend_wait_s", "e2e_s", "finish_reason"]
            ].copy()
            df.insert(1, "open", "request?id=" + df["request_id"].astype(str))
            st.dataframe(
                df,
                hide_index=True,
                key="preempted_requests",
                column_config={"open": st.column_config.LinkColumn("open", display_text="open")},
            )


def fleet_controls(ctx: ui.Context) -> tuple[str, int, list[str]]:
    """What makes an engine worse, how many of the worst to draw, and engines the user adds to them."""
    c = st.columns([1, 1, 3])
    rank_by = c[0].selectbox(
        "worst by", list(fleet.RANK_BY), format_func=fleet.RANK_BY.__getitem__, key="fleet_rank_by"
    )
    top = int(c[1].number_input("worst engines drawn", 0, 20, fleet.TOP, key="fleet_top"))
    engines = sorted(s["source_id"] for s in ctx.data.sources() if s.get("kind") == "engine")
    picked = c[2].multiselect(
        "and these engines",
        engines,
        key="fleet_engines",
        max_selections=fleet.MAX_PICKED,
        placeholder=f"pick up to {fleet.MAX_PICKED} of {len(engines)} engines",
    )
    return rank_by, top, picked


def engines(ctx: ui.Context) -> None:
    """The fleet by model, and the engines worst right now on their own (the rest of each model as one
    line): a legend entry per model or per line drawn, never one per engine."""
    st.subheader("Engines: by model, and the worst right now")
    with ui.ledger_errors("engines"):
        rank_by, top, picked = fleet_controls(ctx)
        bucket_s = bucket_for(fleet.span_s(ctx.data, ctx.since_s, time.time()))
        load = ctx.data.engines(ctx.since, bucket_s=bucket_s, top=top, rank_by=rank_by, source_ids=picked)
        df = fleet.points(load)
        if df.empty:
            st.caption("no engine steps in this window")
            return
        n_models = df.loc[df["kind"] == "model", "series"].nunique()
        st.caption(
            f"{len(load.engines):,} engines of {n_models} models, per {int(bucket_s)} s; the worst "
            f"{top} by {fleet.RANK_BY[rank_by].lower()} in their newest {int(bucket_s)} s drawn on "
            "their own, the other engines of each model as one dotted line (their max)"
        )
        left, right = st.columns(2)
        left.altair_chart(
            charts.by_model(df, "kv_pct_mean", "kv_pct_max", "KV in use (%)", "KV cache in use, by model")
        )
        right.altair_chart(
            charts.by_model(df, "waiting_mean", "waiting_max", "waiting (requests)", "waiting, by model")
        )
        left, right = st.columns(2)
        left.altair_chart(
            charts.worst_engines(df, "kv_pct_max", "KV in use (%)", "KV in use: the worst engines")
        )
        right.altair_chart(
            charts.worst_engines(df, "waiting_max", "waiting (requests)", "waiting: the worst engines")
        )
        st.dataframe(
            fleet.ranking(load),
            hide_index=True,
            height=300,
            key="engine_ranking",
            column_config={
                "KV in use (%)": st.column_config.NumberColumn(format="%.1f"),
                "step (ms)": st.column_config.NumberColumn(format="%.1f"),
            },
        )


def escape_valve(ctx: ui.Context) -> None:
    st.subheader("Escape-valve actions (slow pool, non-preemptible)")
    try:
        df = ctx.data.sql(
            "SELECT decided_ts, request_id, rule, action, state, detail FROM cutoffs "
            "WHERE action IN ('slow_pool', 'non_preemptible', 'promote')"
            + (f" AND decided_ts >= {ctx.since_s:.3f}" if ctx.since_s else "")
            + " ORDER BY decided_ts DESC LIMIT 200"
        )
    except Unavailable:
        st.info("escape-valve actions: not available in this ledger (no /v1/sql yet).")
        return
    except (LedgerError, Exception) as exc:
        st.info(f"escape-valve actions: not available in this ledger ({exc}).")
        return
    if df.empty:
        st.caption("no escape-valve actions in this window")
    else:
        df["decided (UTC)"] = pd.to_datetime(df["decided_ts"].astype(float), unit="s", utc=True)
        st.dataframe(df.drop(columns=["decided_ts"]), hide_index=True)


def body() -> None:
    ctx = ui.context()
    stall_ranking(ctx)
    idle_block_seconds(ctx)
    preemptions(ctx)
    engines(ctx)
    escape_valve(ctx)


st.title("KV & preemption")
ui.refreshing(ui.context(), body)
