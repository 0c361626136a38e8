"""One request: its layers, a Gantt-style timeline (steps it ran and sat out, chunks, preemptions,
token groups, cutoff) and the "why was this slow" list with the requests behind each delay."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import charts, ui
from dashboard.data import LedgerData, NotFound, Unavailable
from dashboard.frames import LAYER_NAMES, LAYERS, arrival, timeline
from dashboard.queries import step_bars_sql
from ledger.analytics.why_answer import Why
from ledger.client import LedgerError
from ledger.records import as_json


def step_bars(data: LedgerData, request: dict[str, Any], t0: float) -> pd.DataFrame | None:
    """The engine steps the request ran in or sat out, as Gantt bars (needs ``/v1/sql``; None without)."""
    query = step_bars_sql(request)
    if query is None:
        return None
    try:
        df = data.sql(query, max_rows=5000)
    except (Unavailable, LedgerError, Exception):
        return None
    if df.empty:
        return None
    return pd.DataFrame(
        {
            "lane": "steps",
            "what": df["ran"].map({True: "ran", False: "sat out"}),
            "start_s": df["ts"] - t0,
            "end_s": df["ts"] + df["duration_s"] - t0,
            "label": "step "
            + df["step"].astype(str)
            + ": "
            + (df["duration_s"] * 1e3).round(1).astype(str)
            + " ms, "
            + df["prefill_tokens"].astype(str)
            + " prefill tokens, "
            + df["num_decode_reqs"].astype(str)
            + " decodes",
        }
    )


def layers_table(r: dict[str, Any]) -> pd.DataFrame:
    rows = [{"layer": LAYER_NAMES[m], "ms": (r.get(m) or 0.0) * 1e3} for m in LAYERS]
    rows.append({"layer": "= end to end", "ms": (r.get("e2e_s") or 0.0) * 1e3})
    rows.append({"layer": "TTFT (engine's first token)", "ms": (r.get("ttft_s") or 0.0) * 1e3})
    if r.get("client_ttft_s") is not None:
        rows.append({"layer": "TTFT at the client", "ms": r["client_ttft_s"] * 1e3})
    return pd.DataFrame(rows)


def why_list(why: Why) -> None:
    if not why.items:
        st.caption("nothing delayed this request beyond its own work")
        return
    for i, item in enumerate(why.items, 1):
        st.markdown(f"**{i}. {item.kind.replace('_', ' ')}: {ui.fmt_ms(item.seconds)}** — {item.detail}")
        if item.culprits:
            df = pd.DataFrame(as_json(item.culprits))
            df.insert(1, "open", "request?id=" + df["request_id"].astype(str))
            st.dataframe(
                df,
                hide_index=True,
                column_config={
                    "open": st.column_config.LinkColumn("open", display_text="open"),
                    "prefill_tokens": st.column_config.NumberColumn("prefill (tokens)"),
                    "max_depth": st.column_config.NumberColumn("deepest (tokens)"),
                },
            )


def render(data: LedgerData, request_id: str) -> None:
    try:
        doc = data.request(request_id)
    except NotFound:
        st.warning(f"no request {request_id!r} in this ledger")
        return
    r, events = doc["request"], doc["events"]
    why: Why | None = None
    with ui.ledger_errors("why"):
        why = data.why(request_id)
    st.subheader(request_id)
    c = st.columns(6)
    client_ttft = r.get("client_ttft_s")
    c[0].metric(
        "TTFT",
        ui.fmt_ms(client_ttft if client_ttft is not None else r.get("ttft_s")),
        help="as the client saw it (first token written by the gateway); the engine's first token: "
        f"{ui.fmt_ms(r.get('ttft_s'))}"
        if client_ttft is not None
        else "the engine's first token (no gateway in front)",
    )
    c[1].metric("end to end", ui.fmt_ms(r.get("e2e_s")) if r.get("e2e_s") is not None else "live")
    c[2].metric(
        "prompt (tokens)", f"{r.get('prompt_tokens') or 0:,}", help=f"{r.get('cached_tokens') or 0} cached"
    )
    c[3].metric("output (tokens)", f"{r.get('output_tokens') or 0:,}")
    c[4].metric("chunks / preemptions", f"{r.get('chunks') or 0} / {r.get('preemptions') or 0}")
    c[5].metric("finish", str(r.get("finish_reason") or "live"), help=r.get("stop_reason") or None)
    trace_id = r.get("trace_id")
    if trace_id:
        link = doc.get("trace_url")
        shown = f"[`{trace_id}`]({link})" if link else f"`{trace_id}`"
        parent = r.get("parent_span_id")
        st.caption(f"trace {shown}" + (f", parent span `{parent}`" if parent else ""))
    if r.get("cut_rule"):
        # cut_rule names any rule whose command a source applied: an abort cuts the request off, an
        # escape valve (slow pool, non-preemptible) only changes how the engine schedules it.
        actions = {e.get("action") for e in events if e.get("kind") == "cutoff_applied"}
        stop = str(r.get("stop_reason") or "")
        if "abort" in actions or r.get("stream_cut_ts") or stop.startswith("chunkledger:"):
            st.error(f"cut off by rule **{r['cut_rule']}** ({stop or r.get('finish_reason')})")
        else:
            done = ", ".join(sorted(a.replace("_", " ") for a in actions if a)) or "applied"
            st.info(f"rule **{r['cut_rule']}**: {done} (an escape valve; the request was not cut off)")
    with ui.ledger_errors("ITL"):
        itl = data.request_itl(request_id)
        if itl.n:
            st.caption(
                f"inter-token gaps: n {itl.n}, p50 {ui.fmt_ms(itl.p50)}, p90 {ui.fmt_ms(itl.p90)}, "
                f"p99 {ui.fmt_ms(itl.p99)}, max {ui.fmt_ms(itl.max)} (mean {ui.fmt_ms(itl.mean)})"
            )
    st.markdown("#### Timeline")
    bars = timeline(r, events, why)
    t0 = arrival(r, events)
    if t0 is not None:
        steps = step_bars(data, r, t0)
        if steps is not None:
            bars = pd.concat([bars[bars.lane != "sat out"], steps], ignore_index=True)
    if bars.empty:
        st.info("no timeline events for this request")
    else:
        st.altair_chart(charts.gantt(bars))
    left, right = st.columns([1, 2])
    with left:
        st.markdown("#### Layers")
        st.dataframe(
            layers_table(r),
            hide_index=True,
            column_config={"ms": st.column_config.NumberColumn("ms", format="%.1f")},
        )
    with right:
        st.markdown("#### Why was this slow")
        if why is not None:
            why_list(why)
    with st.expander(f"events ({len(events)})"):
        st.dataframe(pd.DataFrame(events), hide_index=True)
    with st.expander("ledger row"):
        st.json(r)


def body() -> None:
    ctx = ui.context()
    rid = st.text_input("request id", st.query_params.get("id", ""), key="request_id")
    if not rid:
        st.info("Pick a request on the Requests page, or type its id.")
        return
    if rid != st.query_params.get("id"):
        st.query_params["id"] = rid
    with ui.ledger_errors("request"):
        render(ctx.data, rid)


st.title("Request")
ui.refreshing(ui.context(), body)
