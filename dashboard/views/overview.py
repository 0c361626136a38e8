"""Overview: latency tails over time, layer attribution, throughput, live queue, the engines by model
(and the worst now), cutoffs in the window.

A click on any p99 point opens the Requests page on the requests that finished in that bucket, sorted
by that latency, slowest first.
"""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from dashboard import charts, fleet, ui
from dashboard.data import LedgerData
from dashboard.frames import (
    LATENCIES,
    TAILS,
    bucket_domain,
    bucket_for,
    bucket_start,
    data_span,
    layer_tails,
    layers_long,
    tails_long,
    throughput,
)
from ledger.analytics.answers import AttributionGroup, ModelTails, Tails

MAX_ITL_BUCKETS = 12  # one /v1/itl call each


def requests_behind(bucket_ts: float, bucket_s: float, metric: str) -> dict[str, str]:
    """Query parameters of the Requests page for the requests behind one bucket's point of ``metric``."""
    return {
        "ended_since": f"{bucket_ts:.3f}",
        "ended_until": f"{bucket_ts + bucket_s:.3f}",
        "sort": metric,
        "order": "desc",
    }


def itl_over_time(data: LedgerData, since_s: float, bucket_s: float, now: float) -> pd.DataFrame:
    """ITL tails per bucket up to ``now`` (one /v1/itl call per bucket, at most MAX_ITL_BUCKETS of the
    newest)."""
    first = max(since_s, now - bucket_s * MAX_ITL_BUCKETS)
    start = first - first % bucket_s
    rows = []
    t = start
    while t < now:
        s = data.itl(f"{t:.3f}", f"{t + bucket_s:.3f}")
        if s and s.n:
            for k in (*TAILS, "max"):
                v = getattr(s, k)
                if v is not None:
                    rows.append(
                        {
                            "time": pd.to_datetime(t, unit="s", utc=True),
                            "tail": k,
                            "ms": v * 1e3,
                            "n": s.n,
                        }
                    )
        t += bucket_s
    return pd.DataFrame(rows, columns=["time", "tail", "ms", "n"])


def ttft_metric(groups: list[AttributionGroup]) -> str:
    """TTFT as the clients saw it where a gateway measured it, else the engine's first token."""
    seen = any(layer_tails(g, "client_ttft_s").n for g in groups)
    return "client_ttft_s" if seen else "ttft_s"


NO_TAILS = Tails(n=0, p50=None, p90=None, p99=None, max=None, mean=None)


def headline(
    ctx: ui.Context, overall: AttributionGroup | None, itl: ModelTails | None, ttft: str = "ttft_s"
) -> None:
    cols = st.columns(5)
    for col, (m, label) in zip(cols, ((ttft, "TTFT"), ("e2e_s", "end to end")), strict=False):
        s = layer_tails(overall, m) if overall is not None else NO_TAILS
        col.metric(f"{label} p99", ui.fmt_ms(s.p99), help=f"p50 {ui.fmt_ms(s.p50)}, max {ui.fmt_ms(s.max)}")
        col.caption(f"p50 {ui.fmt_ms(s.p50)} · p90 {ui.fmt_ms(s.p90)} · max {ui.fmt_ms(s.max)}")
    i = itl or NO_TAILS
    cols[2].metric("ITL p99", ui.fmt_ms(i.p99))
    cols[2].caption(f"p50 {ui.fmt_ms(i.p50)} · p90 {ui.fmt_ms(i.p90)} · max {ui.fmt_ms(i.max)}")
    cols[3].metric("finished requests", f"{overall.requests if overall else 0:,}")
    cols[3].caption(f"{overall.output_tokens if overall else 0:,} output tokens")
    cols[4].metric("preemptions", f"{overall.preemptions if overall else 0:,}")


def live(ctx: ui.Context) -> None:
    st.subheader("Live")
    with ui.ledger_errors("live queue"):
        stalls = ctx.data.kv_stalls(limit=1000)
        rows = stalls.requests
        running = sum(1 for r in rows if r.state == "running")
        waiting = sum(1 for r in rows if r.state == "waiting")
        c = st.columns(4)
        c[0].metric("running", f"{running:,}")
        c[1].metric("waiting", f"{waiting:,}")
        worst = max((max(r.stall_s, 0.0) for r in rows), default=None)
        c[2].metric("longest without progress", ui.fmt_ms(worst) if worst is not None else "-")
        c[3].page_link("views/kv.py", label="KV stall ranking →")
        if len(rows) >= 1000:
            st.caption("counts capped at 1,000 live requests")


def engines(ctx: ui.Context) -> None:
    """Each model's engines as their newest bucket saw them, and the worst engines now."""
    st.subheader("Engines")
    with ui.ledger_errors("engines"):
        bucket_s = bucket_for(fleet.span_s(ctx.data, ctx.since_s, time.time()))
        load = ctx.data.engines(ctx.since, bucket_s=bucket_s, top=3)
        if not load.engines:
            st.caption("no engine steps in this window")
            return
        left, right = st.columns([3, 2])
        left.dataframe(
            fleet.models_now(load),
            hide_index=True,
            column_config={
                c: st.column_config.NumberColumn(format="%.1f")
                for c in ("KV in use, mean (%)", "KV in use, max (%)", "step (ms)")
            },
        )
        worst = ", ".join(f"{e.source_id} ({e.kv_usage:.0%})" for e in load.engines[:3])
        right.metric("KV cache in use, the worst engine", f"{load.engines[0].kv_usage:.0%}")
        right.caption(f"worst now: {worst}")
        right.page_link("views/kv.py", label="engines by model and the worst now →")


def cutoffs(ctx: ui.Context) -> None:
    st.subheader("Cutoffs in the window")
    with ui.ledger_errors("cutoffs"):
        df = ctx.data.cutoffs(ctx.since_s)
        if df.empty:
            st.caption("no cutoff decisions in this window")
            return
        summary = df.groupby(["rule", "action", "state"]).size().reset_index(name="decisions")
        st.dataframe(summary.sort_values("decisions", ascending=False), hide_index=True)
        st.page_link("views/cutoffs.py", label="Cutoffs & webhooks →")


def latency_tails(groups: list[AttributionGroup], bucket_s: float, ttft: str) -> None:
    """TTFT and e2e tails over time; a click on a p99 point opens the requests behind it."""
    st.subheader("Latency tails")
    st.caption("click a p99 point to open the requests behind it, slowest first")
    tails = tails_long(groups, (ttft, "e2e_s"))
    left, right = st.columns(2)
    for col, metric in ((left, ttft), (right, "e2e_s")):
        df = tails[tails.metric == metric]
        event = col.altair_chart(
            charts.latency_tails(df, LATENCIES[metric]),
            on_select="rerun",
            selection_mode=charts.P99_SELECTION,
            key=f"tails_{metric}",
        )
        picked = (getattr(event, "selection", None) or {}).get(charts.P99_SELECTION) or []
        if picked and "bucket_ts" in picked[0]:
            st.switch_page(
                "views/requests.py",
                query_params=requests_behind(float(picked[0]["bucket_ts"]), bucket_s, metric),
            )


def itl_tails(ctx: ui.Context, lo: float, hi: float) -> None:
    with ui.ledger_errors("ITL"):
        itl_bucket_s = bucket_for(hi - lo, MAX_ITL_BUCKETS)
        itl_df = itl_over_time(ctx.data, lo, itl_bucket_s, hi)
        if itl_df.empty:
            st.caption("no decode steps in this window")
        else:
            st.altair_chart(charts.itl_tails(itl_df))
            st.caption(f"decode ITL per {int(itl_bucket_s)} s, from the engines' steps")


def where_the_time_went(groups: list[AttributionGroup]) -> None:
    st.subheader("Where the time went")
    layers = layers_long(groups)
    left, right = st.columns(2)
    left.altair_chart(charts.layers_stacked(layers))
    right.altair_chart(charts.layers_p99(layers))


def throughput_rates(groups: list[AttributionGroup], bucket_s: float, span: tuple[float, float]) -> None:
    st.subheader("Throughput")
    tp = throughput(groups, bucket_s)
    left, right = st.columns(2)
    left.altair_chart(charts.rate(tp, "requests_per_s", "finished requests", "requests/s", span))
    right.altair_chart(charts.rate(tp, "output_tokens_per_s", "output tokens", "tokens/s", span))


def p99_links(groups: list[AttributionGroup], bucket_s: float, ttft: str) -> pd.DataFrame:
    """The p99 points of TTFT and e2e per bucket, each with a link to the requests behind it."""
    rows = []
    for g in groups:
        for m in (ttft, "e2e_s"):
            s = layer_tails(g, m)
            if s.p99 is None:
                continue
            qp = requests_behind(bucket_start(g), bucket_s, m)
            rows.append(
                {
                    "bucket (UTC)": ui.fmt_ts(bucket_start(g)),
                    "latency": LATENCIES[m],
                    "p50 ms": (s.p50 or 0.0) * 1e3,
                    "p99 ms": s.p99 * 1e3,
                    "requests": s.n,
                    "open": "requests?" + "&".join(f"{k}={v}" for k, v in qp.items()),
                }
            )
    return pd.DataFrame(rows)


def p99_table(groups: list[AttributionGroup], bucket_s: float, ttft: str) -> None:
    with st.expander("the p99 points as a table (links to the requests behind each)"):
        st.dataframe(
            p99_links(groups, bucket_s, ttft),
            hide_index=True,
            column_config={
                "open": st.column_config.LinkColumn("requests", display_text="open"),
                "p50 ms": st.column_config.NumberColumn(format="%.1f"),
                "p99 ms": st.column_config.NumberColumn(format="%.1f"),
            },
        )


def attribution(ctx: ui.Context, now: float) -> None:
    """The headline figures of the window, then its finished requests bucketed by end time."""
    lo, hi = data_span(ctx.data, ctx.since, ctx.since_s, now)
    bucket_s = bucket_for(hi - lo)
    whole = ctx.data.attribution(ctx.since)
    overall = whole.groups[0] if whole.groups else None
    ttft = ttft_metric([overall] if overall else [])
    headline(ctx, overall, whole.itl[0] if whole.itl else None, ttft)
    groups = ctx.data.attribution(ctx.since, bucket_s=bucket_s).groups
    st.caption(
        f"finished requests by end time, {int(bucket_s)} s buckets; updated {ui.fmt_ts(now)}"
        + (f", every {ctx.refresh_s:g} s" if ctx.refresh_s else "")
    )
    if not groups:
        st.info("No finished requests in this window yet. Charts appear once requests finish.")
        return
    latency_tails(groups, bucket_s, ttft)
    itl_tails(ctx, lo, hi)
    where_the_time_went(groups)
    throughput_rates(groups, bucket_s, bucket_domain(lo, hi, bucket_s))
    p99_table(groups, bucket_s, ttft)


def body() -> None:
    ctx = ui.context()
    with ui.ledger_errors("attribution"):
        attribution(ctx, time.time())
    live(ctx)
    engines(ctx)
    cutoffs(ctx)


st.title("Overview")
ui.refreshing(ui.context(), body)
