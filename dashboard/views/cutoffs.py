"""Cutoffs & webhooks: runaway-rule decisions by rule over time, the decision log, webhook deliveries."""

from __future__ import annotations

import time

import altair as alt
import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.data import Unavailable
from dashboard.frames import bucket_domain, bucket_for
from ledger.client import LedgerError


def _sql(ctx: ui.Context, what: str, query: str) -> pd.DataFrame | None:
    try:
        return ctx.data.sql(query)
    except Unavailable:
        st.info(f"{what}: not available in this ledger (no /v1/sql yet).")
    except (LedgerError, Exception) as exc:
        st.error(f"{what}: the ledger did not answer the page's query ({exc}).")
    return None


def decisions(ctx: ui.Context) -> None:
    st.subheader("Decisions by rule")
    with ui.ledger_errors("cutoffs"):
        df = ctx.data.cutoffs(ctx.since_s)
        if df.empty:
            st.caption("no cutoff decisions in this window")
            return
        show_decisions(ctx, df)


def show_decisions(ctx: ui.Context, df: pd.DataFrame) -> None:
    df["decided_ts"] = df["decided_ts"].astype(float)
    by_rule = df.groupby(["rule", "action"]).size().reset_index(name="decisions")
    c = st.columns(min(4, len(by_rule)) or 1)
    for i, row in by_rule.head(4).iterrows():
        c[int(i) % len(c)].metric(f"{row['rule']} → {row['action']}", f"{row['decisions']:,}")
    now = time.time()
    lo, hi = float(df["decided_ts"].min()), max(now, float(df["decided_ts"].max()))
    bucket_s = bucket_for(hi - lo)
    df["bucket_ts"] = (df["decided_ts"] // bucket_s) * bucket_s
    over = df.groupby(["bucket_ts", "rule"]).size().reset_index(name="decisions")
    over["time"] = pd.to_datetime(over["bucket_ts"], unit="s", utc=True)
    over["time_end"] = pd.to_datetime(over["bucket_ts"] + bucket_s, unit="s", utc=True)
    st.altair_chart(
        charts.bucket_bars(
            over,
            "decisions",
            "decisions",
            f"cutoff decisions per {int(bucket_s)} s, by rule",
            domain=bucket_domain(lo, hi, bucket_s),
            color=alt.Color("rule:N", title="rule"),
            height=200,
            tooltip=[
                alt.Tooltip("time:T", title="from (UTC)", format="%H:%M:%S"),
                "rule:N",
                alt.Tooltip("decisions:Q", title="decisions"),
            ],
        )
    )
    applied = df["applied_ts"].astype(float) - df["decided_ts"]
    st.caption(
        f"decided → applied by the engine: p50 {ui.fmt_ms(applied.quantile(0.5))}, p99 "
        f"{ui.fmt_ms(applied.quantile(0.99))}, max {ui.fmt_ms(applied.max())} ({applied.count()} applied)"
        if applied.count()
        else "no decision confirmed as applied yet"
    )
    log = df.drop(columns=["bucket_ts"]).copy()
    for col in (
        "decided_ts",
        "delivered_ts",
        "applied_ts",
        "gateway_delivered_ts",
        "gateway_applied_ts",
        "closed_ts",
    ):
        if col in log:
            log[col] = pd.to_datetime(log[col].astype(float), unit="s", utc=True)
    log.insert(2, "open", "request?id=" + log["request_id"].astype(str))
    st.dataframe(
        log, hide_index=True, column_config={"open": st.column_config.LinkColumn("open", display_text="open")}
    )


def deliveries(ctx: ui.Context) -> None:
    st.subheader("Webhook deliveries")
    since = f" WHERE o.created_ts >= {ctx.since_s:.3f}" if ctx.since_s else ""
    df = _sql(
        ctx,
        "webhook deliveries",
        # The subscription by its id: /v1/sql never reads webhook_subscriptions (its URLs and secrets
        # are credentials); GET /v1/webhooks names them to an admin.
        "SELECT o.created_ts, o.event_type, o.subscription_id, o.state, o.attempts, o.last_status, "
        "o.last_error, o.delivered_ts - o.created_ts AS delivery_s, o.id AS delivery_id "
        "FROM webhook_outbox o" + since + " ORDER BY o.created_ts DESC LIMIT 500",
    )
    if df is None:
        return
    if df.empty:
        st.caption("no webhook deliveries in this window")
        return
    states = df.groupby("state").size().reset_index(name="deliveries")
    c = st.columns(max(1, len(states)))
    for i, row in states.iterrows():
        c[int(i)].metric(str(row["state"]), f"{row['deliveries']:,}")
    d = df["delivery_s"].dropna().astype(float)
    if len(d):
        st.caption(
            f"created → delivered: p50 {ui.fmt_ms(d.quantile(0.5))}, p99 {ui.fmt_ms(d.quantile(0.99))}, "
            f"max {ui.fmt_ms(d.max())}"
        )
    df["created (UTC)"] = pd.to_datetime(df["created_ts"].astype(float), unit="s", utc=True)
    st.dataframe(df.drop(columns=["created_ts"]), hide_index=True)


def policy(ctx: ui.Context) -> None:
    with st.expander("policy in force"), ui.ledger_errors("policy"):
        st.json(ctx.data.get("/v1/policy"))


def body() -> None:
    ctx = ui.context()
    decisions(ctx)
    deliveries(ctx)
    policy(ctx)


st.title("Cutoffs & webhooks")
ui.refreshing(ui.context(), body)
