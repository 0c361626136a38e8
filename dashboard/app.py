"""The chunkledger dashboard: ``chunkledger dashboard --ledger URL`` (or ``streamlit run dashboard/app.py``).

Reads only through the ledger's HTTP API (``CHUNKLEDGER_LEDGER_URL``, ``CHUNKLEDGER_READ_TOKEN``).
"""

from __future__ import annotations

import streamlit as st

from dashboard import ui

st.set_page_config(page_title="chunkledger", page_icon=":bar_chart:", layout="wide")

PAGES = [
    st.Page("views/overview.py", title="Overview", url_path="overview", default=True),
    st.Page("views/requests.py", title="Requests", url_path="requests"),
    st.Page("views/request.py", title="Request", url_path="request"),
    st.Page("views/kv.py", title="KV & preemption", url_path="kv"),
    st.Page("views/cutoffs.py", title="Cutoffs & webhooks", url_path="cutoffs"),
    st.Page("views/advice.py", title="Chunk advice", url_path="advice"),
    st.Page("views/sql.py", title="SQL console", url_path="sql"),
]

page = st.navigation(PAGES)
st.session_state["ctx"] = ui.sidebar()
page.run()
