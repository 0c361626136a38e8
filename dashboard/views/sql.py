"""SQL console: read-only queries through ``POST /v1/sql``, results as a table and a CSV download."""

from __future__ import annotations

import streamlit as st

from dashboard import ui
from dashboard.data import Refused, Unavailable
from ledger.client import LedgerError

EXAMPLE = """SELECT model, count(*) AS requests,
       quantile_cont(ttft_s, 0.99) AS ttft_p99_s,
       avg(backend_wait_ttft_s / ttft_s) AS backend_wait_share
FROM requests WHERE ttft_s > 0 GROUP BY model ORDER BY requests DESC"""


def body() -> None:
    ctx = ui.context()
    st.caption(
        "One SELECT (or EXPLAIN) at a time, run read-only with a row and time limit. Tables: requests "
        "(the view), steps, events, sources, cutoffs, webhook_outbox; their columns: the docs' SQL "
        "tables page (docs/reference/tables.md)."
    )
    query = st.text_area("SQL", st.query_params.get("q", EXAMPLE), height=160, key="sql_text")
    if st.button("Run", type="primary", key="sql_run"):
        st.session_state["sql_last"] = query
    query = st.session_state.get("sql_last", "")
    if not query:
        return
    try:
        df = ctx.data.sql(query)
    except Unavailable:
        st.info("SQL console: not available in this ledger (no /v1/sql yet).")
        return
    except Refused as exc:
        st.error(f"refused: {exc.detail}")
        return
    except LedgerError as exc:
        st.error(str(exc))
        return
    st.caption(
        f"{len(df):,} rows in {df.attrs.get('elapsed_s') or 0:.3f} s"
        + (" (truncated at the row limit)" if df.attrs.get("truncated") else "")
    )
    st.dataframe(df, hide_index=True)
    st.download_button(
        "Download CSV", df.to_csv(index=False).encode(), file_name="chunkledger-query.csv", mime="text/csv"
    )


st.title("SQL console")
body()
