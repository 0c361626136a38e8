"""Chunk advice: the fitted step-time model over the steps it used, the advised settings for an ITL
target the user types, and what they predict."""

from __future__ import annotations

import numpy as np
import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.data import LedgerData, Refused, Unavailable
from ledger.advice.answer import ChunkSizeAdvice, CoefficientRow
from ledger.client import LedgerError
from ledger.records import as_json

PLOT_STEPS = 3000


def _term_values(term: str, df: pd.DataFrame) -> np.ndarray:
    """The regressor of one fitted term for each observed step (the fit's own definitions)."""
    t = df["prefill_tokens"].to_numpy(float)
    cols = {
        "intercept": np.ones(len(df)),
        "prefill_tokens": t,
        "prefill_depth_tokens": df["prefill_depth_tokens"].to_numpy(float),
        "num_decode_reqs": df["num_decode_reqs"].to_numpy(float),
        "num_prefill_reqs": df["num_prefill_reqs"].to_numpy(float),
        "max_prefill_depth": df["max_prefill_depth"].to_numpy(float),
        "prefill_tokens_sq": t**2 / np.maximum(df["num_prefill_reqs"].to_numpy(float), 1.0),
        "kv_usage": df["kv_usage"].to_numpy(float),
    }
    return cols.get(term, np.zeros(len(df)))


def _curve_value(term: str, t: np.ndarray, depth: float, decodes: float, kv: float) -> np.ndarray:
    """The regressor for one chunk of ``t`` tokens at ``depth`` beside ``decodes`` decodes (as the
    advisor predicts a step)."""
    one = np.ones_like(t)
    return {
        "intercept": one,
        "prefill_tokens": t,
        "prefill_depth_tokens": t * depth,
        "num_decode_reqs": one * decodes,
        "num_prefill_reqs": (t > 0).astype(float),
        "max_prefill_depth": np.where(t > 0, depth, 0.0),
        "prefill_tokens_sq": t * t,
        "kv_usage": one * kv,
    }.get(term, np.zeros_like(t))


def predict_points(coefs: list[CoefficientRow], df: pd.DataFrame) -> np.ndarray:
    return sum((c.ms_per_unit * _term_values(c.term, df) for c in coefs), np.zeros(len(df)))


def curves(advice: ChunkSizeAdvice) -> pd.DataFrame:
    fit, load = advice.fit, advice.load
    coefs = fit.coefficients
    hi = max(fit.covers.prefill_tokens[1], 1)
    t = np.linspace(0, hi, 60)
    decodes = float(load.decode_batch_p50)
    kv = float(load.kv_usage_p99)
    out = []
    for label, depth in (
        ("depth 0", 0.0),
        (f"depth p50 ({load.prefill_depth_p50:,})", float(load.prefill_depth_p50)),
        (f"depth p99 ({load.prefill_depth_p99:,})", float(load.prefill_depth_p99)),
    ):
        y = sum(
            (c.ms_per_unit * _curve_value(c.term, t, depth, decodes, kv) for c in coefs),
            np.zeros_like(t),
        )
        out.append(
            pd.DataFrame({"prefill_tokens": t, "predicted_ms": y, "curve": f"{label}, {decodes:g} decodes"})
        )
    return pd.concat(out, ignore_index=True)


def observed_steps(data: LedgerData, advice: ChunkSizeAdvice) -> pd.DataFrame | None:
    w = advice.window
    if not w.source_ids:
        return None
    where = ["source_id IN (" + ", ".join(ui.sql_literal(s) for s in w.source_ids) + ")"]
    if w.first_step_ts is not None:
        where.append(f"ts >= {float(w.first_step_ts)!r}")
    if w.last_step_ts is not None:
        where.append(f"ts <= {float(w.last_step_ts)!r}")
    try:
        df = data.sql(
            "SELECT duration_s, prefill_tokens, prefill_depth_tokens, max_prefill_depth, num_prefill_reqs, "
            f"num_decode_reqs, kv_usage FROM steps WHERE {' AND '.join(where)} AND duration_s > 0 "
            f"ORDER BY ts DESC LIMIT {PLOT_STEPS}",
            max_rows=PLOT_STEPS,
        )
    except (Unavailable, LedgerError, Exception):
        return None
    if df.empty:
        return None
    df = df.astype(float)
    df["duration_ms"] = df["duration_s"] * 1e3
    df["predicted_ms"] = predict_points(advice.fit.coefficients, df)
    return df


def show(data: LedgerData, advice: ChunkSizeAdvice) -> None:
    settings_(advice)
    fit_(data, advice)


def settings_(advice: ChunkSizeAdvice) -> None:
    s, p, tp = advice.settings, advice.predicted, advice.throughput
    c = st.columns(4)
    c[0].metric("max_num_batched_tokens", f"{s.max_num_batched_tokens:,}")
    c[1].metric("long_prefill_token_threshold", f"{s.long_prefill_token_threshold:,}")
    c[2].metric("predicted ITL p99", f"{p.itl_p99_ms:,.1f} ms", help=f"at depth {advice.depth:,}")
    c[3].metric("predicted ITL p99 at depth 0", f"{p.itl_p99_at_depth_0_ms:,.1f} ms")
    st.caption(
        f"prefill budget per step {advice.prefill_budget_ms:,.1f} ms (target - decode at p99 batch "
        f"{advice.decode_ms.at_p99_batch:,.1f} ms), margin {advice.margin_ms:,.1f} ms "
        f"({advice.margin_from}); prefill throughput {tp.prefill_tokens_per_s or 0:,.0f} tokens/s vs "
        f"{tp.unconstrained_tokens_per_s:,.0f} unconstrained (cost {tp.cost:.0%})"
    )
    for note in advice.notes:
        st.warning(note)


def fit_(data: LedgerData, advice: ChunkSizeAdvice) -> None:
    """The fitted step-time model over the steps it used (it does not depend on the ITL target)."""
    fit = advice.fit
    st.subheader("Fitted step time")
    st.markdown(
        f"`step_ms = {fit.model}` · R² {fit.r2:.3f} · "
        f"cross-validated error {fit.cv_rel_error:.1%} · "
        f"residual p50 {fit.residual_ms.p50:.2f} ms, p99 {fit.residual_ms.p99:.2f} ms, "
        f"max {fit.residual_ms.max:.2f} ms · {fit.steps_used:,} steps"
    )
    pts = observed_steps(data, advice)
    if pts is None:
        st.info("the steps the fit used: not available in this ledger (needs /v1/sql); curves only")
        st.altair_chart(
            charts.step_fit(
                pd.DataFrame(
                    columns=[
                        "prefill_tokens",
                        "duration_ms",
                        "max_prefill_depth",
                        "num_decode_reqs",
                        "predicted_ms",
                    ]
                ),
                curves(advice),
            )
        )
    else:
        left, right = st.columns([3, 2])
        left.altair_chart(charts.step_fit(pts, curves(advice)))
        right.altair_chart(charts.residuals(pts))
        st.caption(f"the newest {len(pts):,} of the steps the fit read")
    st.dataframe(pd.DataFrame(as_json(fit.coefficients)), hide_index=True)
    st.subheader("By depth")
    st.dataframe(pd.DataFrame(as_json(advice.by_depth)), hide_index=True)
    with st.expander("what the fit covers and the load it saw"):
        st.json(as_json({"covers": fit.covers, "load": advice.load, "window": advice.window}))


def fit_for_refused(ctx: ui.Context, target: float, model: str | None, share: float) -> None:
    """Without advice for the target, still show the fitted model: the fit is the same for any target,
    so ask for looser ones until one is answered."""
    for looser in (target * 4, 1000.0, 10_000.0):
        try:
            advice = ctx.data.advice(looser, model=model, since=ctx.since, arrival_share=share)
        except (Refused, LedgerError):
            continue
        st.caption(f"the fitted model below comes from the advice for a {looser:g} ms target (same fit)")
        fit_(ctx.data, advice)
        return


def body() -> None:
    ctx = ui.context()
    c = st.columns([1, 1, 2])
    target = c[0].number_input(
        "ITL target (ms, p99)", min_value=1.0, max_value=600_000.0, value=50.0, step=5.0, key="itl_target"
    )
    share = c[1].number_input(
        "share kept for arrivals", min_value=0.0, max_value=0.95, value=0.25, step=0.05, key="arrival_share"
    )
    model = c[2].text_input("model (when the ledger has several)", "", key="advice_model") or None
    try:
        advice = ctx.data.advice(target, model=model, since=ctx.since, arrival_share=share)
    except Unavailable:
        st.info("chunk advice: not available in this ledger (no /v1/advice/chunk-size yet).")
        return
    except Refused as exc:
        st.warning(f"no advice for {target:g} ms: {exc.detail}")
        fit_for_refused(ctx, target, model, share)
        return
    except LedgerError as exc:
        st.error(f"chunk advice: {exc}")
        return
    show(ctx.data, advice)


st.title("Chunk advice")
ui.refreshing(ui.context(), body)
