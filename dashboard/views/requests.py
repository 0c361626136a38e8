"""Requests: the ledger's request rows, filtered and sorted by any layer; a row opens its request page.

Query parameters (what the overview's p99 links set): ``sort``, ``order``, ``ended_since`` /
``ended_until`` (unix seconds: the requests that finished in that span), ``model``, ``finish_reason``.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from dashboard import ui
from dashboard.frames import LATENCIES

LAYER_COLUMNS = [
    "client_ttft_s",
    "ttft_s",
    "e2e_s",
    "entry_s",
    "admission_s",
    "frontend_s",
    "engine_queue_s",
    "backend_wait_ttft_s",
    "prefill_s",
    "decode_s",
    "kv_idle_s",
]
SHOWN = [
    "request_id",
    *LAYER_COLUMNS,
    "prompt_tokens",
    "cached_tokens",
    "output_tokens",
    "chunks",
    "preemptions",
    "stalled_steps",
    "kv_idle_block_s",
    "finish_reason",
    "cut_rule",
    "model",
    "engine_source_id",
    "start_ts",
    "end_ts",
]
SORTS = [
    *LAYER_COLUMNS,
    "start_ts",
    "end_ts",
    "prompt_tokens",
    "output_tokens",
    "chunks",
    "preemptions",
    "kv_idle_block_s",
    "stalled_steps",
]
PAGE = 200


def fetch(ctx: ui.Context, p: dict[str, Any], ended: tuple[float, float] | None) -> tuple[int, pd.DataFrame]:
    """One page of rows. For an end-time span, look back from its start by the slowest e2e that could
    end in it and keep only the rows that ended inside (the API windows by start time)."""
    params = dict(p)
    if ended is not None:
        lo, hi = ended
        slowest = ctx.data.requests(
            sort="e2e_s", order="desc", limit=1, live=False, since=f"{lo - 86400:.3f}", until=f"{hi:.3f}"
        )
        worst = (slowest["rows"][0].get("e2e_s") if slowest["rows"] else 0.0) or 0.0
        params.update(since=f"{lo - worst - 1:.3f}", until=f"{hi:.3f}", live=False, limit=1000, offset=0)
        out = ctx.data.requests(**params)
        df = pd.DataFrame(out["rows"])
        if not df.empty:
            df = df[(df.end_ts >= lo) & (df.end_ts < hi)].head(PAGE)
        return len(df), df
    out = ctx.data.requests(**params)
    return int(out["total"]), pd.DataFrame(out["rows"])


def table(df: pd.DataFrame) -> pd.DataFrame:
    view = df[[c for c in SHOWN if c in df.columns]].copy()
    for c in LAYER_COLUMNS:
        if c in view:
            view[c] = view[c] * 1e3
    for c in ("start_ts", "end_ts"):
        if c in view:
            view[c] = pd.to_datetime(view[c], unit="s", utc=True)
    view.insert(1, "open", "request?id=" + view["request_id"].astype(str))
    return view


def body() -> None:
    ctx = ui.context()
    qp = st.query_params
    sort_default = qp.get("sort", "e2e_s")
    order_default = qp.get("order", "desc")
    c = st.columns([2, 1, 2, 2, 1])
    sort = c[0].selectbox(
        "sort by",
        SORTS,
        index=SORTS.index(sort_default) if sort_default in SORTS else SORTS.index("e2e_s"),
        format_func=lambda s: f"{LATENCIES.get(s, s)} ({s})",
        key="req_sort",
    )
    order = c[1].radio("order", ["desc", "asc"], index=0 if order_default == "desc" else 1, key="req_order")
    model = c[2].text_input("model", qp.get("model", ""), key="req_model") or None
    finish = (
        c[3].selectbox(
            "finish reason", ["", "stop", "length", "abort", "cutoff", "error"], key="req_finish", index=0
        )
        or qp.get("finish_reason")
        or None
    )
    state = c[4].radio("state", ["all", "finished", "live"], key="req_state")
    lo, hi = ui.query_float("ended_since"), ui.query_float("ended_until")
    ended = (lo, hi) if lo is not None and hi is not None else None
    if ended:
        st.info(
            f"requests that finished between {ui.fmt_ts(ended[0])} and {ui.fmt_ts(ended[1])} "
            f"(the bucket behind an overview point), sorted by {LATENCIES.get(sort, sort)}"
        )
        if st.button("clear the bucket filter"):
            for k in ("ended_since", "ended_until"):
                del st.query_params[k]
            st.rerun()
    params: dict[str, Any] = {
        "since": None if ended else ctx.since,
        "sort": sort,
        "order": order,
        "model": model,
        "finish_reason": finish,
        "live": None if state == "all" else state == "live",
        "limit": PAGE,
    }
    with ui.ledger_errors("requests"):
        total, df = fetch(ctx, params, ended)
        if df.empty:
            st.info("No requests match (in this window).")
            return
        st.caption(
            f"{total:,} requests match; showing {len(df):,}. Latencies in ms; select a row to open it."
        )
        event = st.dataframe(
            table(df),
            hide_index=True,
            on_select="rerun",
            selection_mode="single-row",
            key="req_table",
            height=min(40 + 35 * len(df), 720),
            column_config={
                "open": st.column_config.LinkColumn("open", display_text="open"),
                **{
                    col: st.column_config.NumberColumn(f"{LATENCIES.get(col, col)} (ms)", format="%.1f")
                    for col in LAYER_COLUMNS
                },
                "kv_idle_block_s": st.column_config.NumberColumn("KV idle (block·s)", format="%.1f"),
            },
        )
        rows = (getattr(event, "selection", None) or {}).get("rows") or []
        if rows:
            st.switch_page("views/request.py", query_params={"id": str(df.iloc[rows[0]]["request_id"])})


st.title("Requests")
ui.refreshing(ui.context(), body)
