"""What-if: the window's own traffic replayed under other engine settings (``GET /v1/whatif``).

A replay costs the ledger seconds of CPU, so it runs when the form is sent, not on every refresh; the
last answer stays on the page (session state) until the next one.
"""

from __future__ import annotations

import msgspec
import streamlit as st

from dashboard import charts, ui
from dashboard.data import LedgerData
from dashboard.frames import short_setting, whatif_rows
from ledger.whatif.answer import WhatIf

DEFAULT_SWEEP = "max_num_batched_tokens=256,512,1024,2048"


# The form's fields start from the query parameters of the same names (sweep, set, policy, recorded,
# itl, ttft, model, force=1), and run=1 runs it once: a what-if can be linked to.


def _query(name: str, default: str = "") -> str:
    value = st.query_params.get(name)
    return value if isinstance(value, str) else default


def _number(name: str) -> float:
    try:
        return max(0.0, float(_query(name, "0")))
    except ValueError:
        return 0.0


def ask(data: LedgerData, since: str | None) -> WhatIf | None:
    policies = ["", "fcfs", "priority", "kv-idle"]
    with st.form("whatif"):
        c = st.columns([2, 2, 1])
        sweep = c[0].text_input("sweep (key=v1,v2,...)", _query("sweep", DEFAULT_SWEEP), key="wi_sweep")
        sets = c[1].text_input(
            "also replay (key=value[,key=value]; several separated by ;)", _query("set"), key="wi_set"
        )
        asked_policy = _query("policy")
        policy = c[2].selectbox(
            "policy",
            policies,
            format_func=lambda p: p or "as recorded",
            index=policies.index(asked_policy) if asked_policy in policies else 0,
            key="wi_policy",
        )
        c = st.columns([3, 1, 1, 1])
        recorded = c[0].text_input(
            "recorded settings (the rest are inferred; num_kv_blocks when the window has preemptions)",
            _query("recorded"),
            key="wi_recorded",
        )
        itl = c[1].number_input(
            "ITL target (ms)", min_value=0.0, value=_number("itl"), step=5.0, key="wi_itl"
        )
        ttft = c[2].number_input(
            "TTFT target (ms)", min_value=0.0, value=_number("ttft"), step=50.0, key="wi_ttft"
        )
        model = c[3].text_input("model", _query("model"), key="wi_model")
        force = st.checkbox(
            "answer even when the calibration error is large", value=_query("force") == "1", key="wi_force"
        )
        sent = st.form_submit_button("Replay")
    linked = _query("run") == "1" and "wi_answer" not in st.session_state
    if sent or linked:
        params = {
            "sweep": sweep or None,
            "set": [s.strip() for s in sets.split(";") if s.strip()],
            "policy": policy or None,
            "recorded": recorded or None,
            "itl_target_ms": itl or None,
            "ttft_target_ms": ttft or None,
            "model": model or None,
            "since": since,
            "force": "true" if force else None,
        }
        st.session_state["wi_answer"] = None
        with ui.ledger_errors("what-if"):
            st.session_state["wi_answer"] = data.whatif(**params)
    answer: WhatIf | None = st.session_state.get("wi_answer")
    return answer


def show(answer: WhatIf) -> None:
    w, cal, fit = answer.window, answer.calibration, answer.fit
    inferred = ", ".join(cal.inferred) or "none"
    long = answer.long_prompt_tokens
    longs = f">= {long:,} tokens" if long else "none"
    st.caption(
        f"{w.requests:,} requests of model {w.model or '-'} on {len(w.source_ids)} engine(s); "
        f"step-time fit R² {fit.r2:.3f}; long prompts: "
        f"{longs}"
        f"; inferred from the steps: {inferred}"
    )
    worst = cal.max_error
    c = st.columns(3)
    c[0].metric("calibration error (max)", "-" if worst is None else f"{worst:.0%}")
    c[1].metric("allowed", f"{cal.max_error_allowed:.0%}")
    best = [r.name for r in answer.candidates if r.best]
    c[2].metric("best setting", short_setting(best[0]) if best else "-", help=best[0] if best else None)
    if worst is not None and worst > cal.max_error_allowed:
        st.warning(
            f"the recorded setting replayed misses a measured tail by {worst:.0%}: the model does not "
            "describe this window (state the recorded settings, or pick one model); read the predictions "
            "as a direction at most"
        )
    df = whatif_rows(answer)
    st.dataframe(
        df.drop(columns=["label"]).round({c: 1 for c in df.columns if c.endswith("_ms")}),
        hide_index=True,
        column_config={"change_short_ttft": st.column_config.NumberColumn(format="percent")},
    )
    left, right = st.columns(2)
    left.altair_chart(charts.bars(df, "short_ttft_p99_ms", "label", "short TTFT p99 (ms)", "", "kind"))
    right.altair_chart(charts.bars(df, "itl_p99_ms", "label", "ITL p99 (ms)", "", "kind"))
    with st.expander("recorded setting and window"):
        st.json(msgspec.to_builtins({"recorded": cal.settings, "window": w}))


def body() -> None:
    ctx = ui.context()
    answer = ask(ctx.data, ctx.since)
    if answer is None:
        st.info(
            "Replays the window's recorded requests through a model of vLLM's scheduler under the settings "
            "asked, with step times fitted from the same window. Send the form to run it."
        )
        return
    show(answer)


st.title("What-if")
body()
