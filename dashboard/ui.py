"""Shared page furniture: the ledger handle, the time window, auto-refresh and error notes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import streamlit as st

from dashboard import queries
from dashboard.data import WINDOWS, LedgerData, NotFound, Refused, Settings, Unavailable
from ledger.analytics.window import BadTime, parse_time
from ledger.client import LedgerError


@dataclass(frozen=True)
class Context:
    """What every page needs: where to read, which window, how often to refresh."""

    data: LedgerData
    since: str | None  # as the API takes it: an age like "1h", or unix seconds; None = all time
    since_s: float | None  # the same as unix seconds, at the time of this run
    refresh_s: float | None  # None: auto-refresh off


def settings() -> Settings:
    if "settings" not in st.session_state:
        st.session_state["settings"] = Settings.from_env()
    s: Settings = st.session_state["settings"]
    return s


def sidebar() -> Context:
    """The sidebar shared by every page: ledger URL, window, auto-refresh."""
    s = settings()
    data = LedgerData.from_settings(s)
    with st.sidebar:
        st.caption(f"ledger: `{s.url}`")
        labels = list(WINDOWS)
        qp = st.query_params.get("window")
        default = labels.index(qp) if qp in labels else labels.index("1 hour")
        window = st.selectbox("window", labels, index=default, key="window", help="requests by end time")
        auto = st.toggle("auto-refresh", value=s.refresh_s > 0, key="auto_refresh")
        every = st.number_input(
            "every (s)",
            min_value=2.0,
            max_value=600.0,
            value=max(s.refresh_s, 2.0),
            step=1.0,
            key="refresh_s",
        )
    since = WINDOWS[window] or None
    return Context(
        data=data,
        since=since,
        since_s=parse_time(since) if since else None,
        refresh_s=float(every) if auto else None,
    )


def context() -> Context:
    ctx = st.session_state.get("ctx")
    if ctx is None:  # a page run on its own (tests): build it without the sidebar widgets
        s = settings()
        ctx = Context(LedgerData.from_settings(s), "1h", time.time() - 3600, None)
    assert isinstance(ctx, Context)
    return ctx


def refreshing(ctx: Context, body: Callable[[], None]) -> None:
    """Run ``body`` as a fragment that re-runs every ``ctx.refresh_s`` seconds (or once)."""
    if ctx.refresh_s:
        st.fragment(body, run_every=ctx.refresh_s)()
    else:
        body()


@contextmanager
def ledger_errors(what: str) -> Iterator[None]:
    """Turn the ledger's answers into notes on the page instead of exception boxes."""
    try:
        yield
    except Unavailable:
        st.info(f"{what}: not available in this ledger (its API has no such endpoint yet).")
    except NotFound as exc:
        st.warning(f"{what}: {exc}")
    except Refused as exc:
        st.warning(f"{what}: the ledger declined: {exc.detail}")
    except LedgerError as exc:
        st.error(f"{what}: {exc}")


def fmt_ms(seconds: float | None) -> str:
    return (
        "-"
        if seconds is None
        else f"{seconds * 1e3:,.0f} ms"
        if seconds >= 0.1
        else f"{seconds * 1e3:,.1f} ms"
    )


def fmt_ts(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d} UTC"


def query_float(name: str) -> float | None:
    v = st.query_params.get(name)
    if v is None or v == "":
        return None
    try:
        return parse_time(v)
    except BadTime:
        st.warning(f"query parameter {name}={v!r} is not a time; ignored")
        return None


sql_literal = queries.sql_literal
