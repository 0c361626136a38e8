"""The chunkledger dashboard: ``chunkledger dashboard --ledger URL`` (or ``streamlit run dashboard/app.py``).

Reads only through the ledger's HTTP API (``CHUNKLEDGER_LEDGER_URL``, ``CHUNKLEDGER_READ_TOKEN``).
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboard import ui

FAVICON = Path(__file__).with_name("favicon.png")
TITLE = "chunkledger"

# No Deploy button or developer menu for operators: client.toolbarMode = "viewer", from
# dashboard/.streamlit/config.toml (read next to this script, from any working directory) and from
# ``chunkledger dashboard``'s command line. (st.set_option here would come too late for the first page.)
st.set_page_config(
    page_title=TITLE,
    page_icon=str(FAVICON) if FAVICON.exists() else ":bar_chart:",
    layout="wide",
    menu_items={"About": "chunkledger: a request ledger for vLLM with chunked prefill."},
)

PAGES = [
    st.Page("views/overview.py", title="Overview", url_path="overview", default=True),
    st.Page("views/requests.py", title="Requests", url_path="requests"),
    st.Page("views/request.py", title="Request", url_path="request"),
    st.Page("views/kv.py", title="KV & preemption", url_path="kv"),
    st.Page("views/cutoffs.py", title="Cutoffs & webhooks", url_path="cutoffs"),
    st.Page("views/advice.py", title="Chunk advice", url_path="advice"),
    st.Page("views/whatif.py", title="What-if", url_path="whatif"),
    st.Page("views/sql.py", title="SQL console", url_path="sql"),
]

page = st.navigation(PAGES)
st.session_state["ctx"] = ui.sidebar()
page.run()
