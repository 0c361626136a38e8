"""Altair charts: units on every axis, tails drawn next to (never instead of) means.

Sizes: every chart is drawn with ``autosize: fit-x`` (``sized``): its width follows the page and its
``height`` is the plot's own height, with the title, axes and legends added around it. Streamlit's
default (``fit`` in both directions) makes ``height`` the whole chart's: a chart title, an x axis and a
y-axis title longer than what was left of the plot squeezed the plot to nothing (the KV page's
preemption bars were drawn 0 px tall, and its axis titles ran off the chart). Axis titles are short
(what and unit; the chart title says the rest) so that they fit along their axis.

Time-bucketed bars span their bucket (``time`` to ``time_end``) on an x scale that covers the whole
data span: one bucket is a bar as wide as its bucket, not a sliver alone in the middle.
"""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

TAIL_COLORS = alt.Scale(
    domain=["p50", "p90", "p99", "max"], range=["#4c78a8", "#f58518", "#e45756", "#9d9d9d"]
)
TAIL_DASH = alt.Scale(domain=["p50", "p90", "p99", "max"], range=[[1, 0], [1, 0], [1, 0], [3, 3]])
LAYER_COLORS = alt.Scale(
    domain=["entry", "admission", "engine front end", "engine queue", "prefill", "decode"],
    range=["#bab0ac", "#9ecae9", "#ff9d98", "#e45756", "#f58518", "#54a24b"],
)
GANTT_COLORS = alt.Scale(
    domain=[
        "entry",
        "admission",
        "engine front end",
        "engine queue",
        "prefill",
        "decode",
        "delivered",
        "ran",
        "chunk",
        "tokens",
        "sat out",
        "preempted",
        "cutoff",
    ],
    range=[
        "#bab0ac",
        "#9ecae9",
        "#ff9d98",
        "#e45756",
        "#f58518",
        "#54a24b",
        "#4c78a8",
        "#72b7b2",
        "#f58518",
        "#54a24b",
        "#b279a2",
        "#d62728",
        "#000000",
    ],
)
# labelFlush: the first and last time labels stay inside the plot (the last one was cut at the edge)
TIME_AXIS = alt.X("time:T", title="time (UTC)", axis=alt.Axis(format="%H:%M:%S", labelFlush=True))
P99_SELECTION = "p99_point"
AUTOSIZE = alt.AutoSizeParams(type="fit-x", contains="padding")
# room inside the chart's edges: glyphs of the outermost labels and titles are not clipped
PADDING = {"left": 6, "top": 6, "right": 14, "bottom": 6}

Sizeable = Any  # an Altair chart: Chart, LayerChart, ...


def sized(chart: Sizeable, height: int | alt.Step, title: str | None = None) -> Any:
    """``chart`` with a plot ``height`` that titles and axes do not eat into (see the module doc)."""
    chart = chart.properties(height=height, autosize=AUTOSIZE, padding=PADDING)
    return chart if title is None else chart.properties(title=title)


def time_x(domain: tuple[float, float] | None = None) -> alt.X:
    """The time axis (UTC); ``domain`` (unix seconds) fixes its extent, e.g. to the buckets' span."""
    if domain is None:
        return TIME_AXIS
    lo, hi = (pd.to_datetime(t, unit="s", utc=True).isoformat() for t in domain)
    return alt.X(
        "time:T", title="time (UTC)", axis=alt.Axis(format="%H:%M:%S"), scale=alt.Scale(domain=[lo, hi])
    )


def bucket_bars(
    df: pd.DataFrame,
    field: str,
    y_title: str,
    title: str,
    *,
    domain: tuple[float, float] | None = None,
    color: str | alt.Color = "#4c78a8",
    height: int = 180,
    tooltip: list[Any] | None = None,
) -> Any:
    """One bar per time bucket from ``time`` to ``time_end``, from 0 up to ``field`` (the series of a
    ``color`` field stack, in the frame's order). A bar spanning x and x2 gets no baseline from
    Vega-Lite (it would be drawn as a thin line at its value), so the bars' bottoms and tops are
    computed here."""
    df = df.copy()
    df["_top"] = df.groupby("time")[field].cumsum() if len(df) else df[field]
    df["_bottom"] = df["_top"] - df[field]
    fixed = isinstance(color, str)  # one color for every bar, else a color encoding
    bars = alt.Chart(df).mark_bar(stroke="white", strokeWidth=0.5, color=color if fixed else alt.Undefined)
    bars = bars.encode(
        x=time_x(domain),
        x2="time_end:T",
        y=alt.Y("_top:Q", title=y_title, scale=alt.Scale(zero=True)),
        y2="_bottom:Q",
        tooltip=tooltip
        or [
            alt.Tooltip("time:T", title="from (UTC)", format="%H:%M:%S"),
            alt.Tooltip("time_end:T", title="to (UTC)", format="%H:%M:%S"),
            alt.Tooltip(f"{field}:Q", format=",.2f"),
        ],
        color=alt.Undefined if fixed else color,
    )
    return sized(bars, height, title)


def latency_tails(
    df: pd.DataFrame, title: str, *, selectable: bool = True
) -> alt.LayerChart | alt.FacetChart:
    """p50/p90/p99 (and max, dashed) of one latency over time, in ms; p99 points are clickable."""
    base = alt.Chart(df).encode(
        x=TIME_AXIS,
        y=alt.Y("ms:Q", title="latency (ms)", scale=alt.Scale(zero=True)),
        color=alt.Color("tail:N", scale=TAIL_COLORS, title="tail"),
        tooltip=[
            alt.Tooltip("time:T", title="bucket (UTC)", format="%H:%M:%S"),
            "tail:N",
            alt.Tooltip("ms:Q", title="ms", format=",.1f"),
            alt.Tooltip("n:Q", title="requests"),
        ],
    )
    lines = base.mark_line(point=False).encode(
        strokeDash=alt.StrokeDash("tail:N", scale=TAIL_DASH, legend=None)
    )
    points = base.transform_filter(alt.datum.tail == "p99").mark_point(filled=True, size=70, cursor="pointer")
    if selectable:
        sel = alt.selection_point(name=P99_SELECTION, fields=["bucket_ts", "metric"], on="click")
        points = points.add_params(sel)
    return sized(alt.layer(lines, points), 220, f"{title}: p50 / p90 / p99 / max")


def itl_tails(df: pd.DataFrame) -> alt.Chart:
    return sized(
        alt.Chart(df)
        .mark_line(point=True)
        .encode(
            x=TIME_AXIS,
            y=alt.Y("ms:Q", title="ITL (ms)"),
            color=alt.Color("tail:N", scale=TAIL_COLORS, title="tail"),
            strokeDash=alt.StrokeDash("tail:N", scale=TAIL_DASH, legend=None),
            tooltip=[
                alt.Tooltip("time:T", format="%H:%M:%S"),
                "tail:N",
                alt.Tooltip("ms:Q", format=",.1f"),
                "n:Q",
            ],
        ),
        220,
        "decode ITL: p50 / p90 / p99 / max",
    )


def layers_stacked(df: pd.DataFrame) -> alt.Chart:
    """Mean of each layer, stacked: the stack's height is mean e2e (the layers add up exactly)."""
    return sized(
        alt.Chart(df)
        .mark_bar(size=bar_px(df))
        .encode(
            x=TIME_AXIS,
            y=alt.Y("mean_ms:Q", title="mean (ms)", stack="zero"),
            color=alt.Color("layer:N", scale=LAYER_COLORS, title="layer", sort=list(LAYER_COLORS.domain)),
            order=alt.Order("order:Q"),
            tooltip=[
                alt.Tooltip("time:T", format="%H:%M:%S"),
                "layer:N",
                alt.Tooltip("mean_ms:Q", title="mean ms", format=",.1f"),
                alt.Tooltip("share:Q", title="share of e2e", format=".0%"),
                alt.Tooltip("p99_ms:Q", title="p99 ms", format=",.1f"),
            ],
        ),
        240,
        "layer attribution: mean per request, stacked",
    )


def layers_p99(df: pd.DataFrame) -> alt.Chart:
    return sized(
        alt.Chart(df)
        .mark_line(point=True)
        .encode(
            x=TIME_AXIS,
            y=alt.Y("p99_ms:Q", title="p99 (ms)"),
            color=alt.Color("layer:N", scale=LAYER_COLORS, title="layer", sort=list(LAYER_COLORS.domain)),
            tooltip=[
                alt.Tooltip("time:T", format="%H:%M:%S"),
                "layer:N",
                alt.Tooltip("p99_ms:Q", format=",.1f"),
            ],
        ),
        240,
        "layer attribution: p99 per layer",
    )


def bar_px(df: pd.DataFrame, width_px: int = 420) -> float:
    """Bar width for time-bucketed bars: the buckets share the plot's width."""
    return max(2.0, min(40.0, 0.8 * width_px / max(1, df["time"].nunique())))


def rate(
    df: pd.DataFrame, field: str, title: str, unit: str, domain: tuple[float, float] | None = None
) -> alt.Chart:
    """A per-second rate per time bucket (``df`` has ``time`` and ``time_end``), in ``unit``."""
    return bucket_bars(df, field, unit, title, domain=domain)


def gantt(df: pd.DataFrame) -> alt.LayerChart | alt.FacetChart:
    """Bars per lane from start_s to end_s (seconds since arrival); zero-width bars become ticks."""
    lanes = ["layers", "client", "steps", "engine", "sat out", "cutoff"]
    y = alt.Y("lane:N", title=None, sort=lanes)
    tooltip = [
        "what:N",
        alt.Tooltip("start_s:Q", title="from (s)", format=",.3f"),
        alt.Tooltip("end_s:Q", title="to (s)", format=",.3f"),
        "label:N",
    ]
    color = alt.Color(
        "what:N", scale=GANTT_COLORS, title="what", legend=alt.Legend(orient="bottom", columns=6)
    )
    bars = (
        alt.Chart(df)
        .transform_filter(alt.datum.end_s > alt.datum.start_s)
        .mark_bar()
        .encode(
            x=alt.X("start_s:Q", title="since arrival (s)"),
            x2="end_s:Q",
            y=y,
            color=color,
            tooltip=tooltip,
        )
    )
    ticks = (
        alt.Chart(df)
        .transform_filter(alt.datum.end_s <= alt.datum.start_s)
        .mark_tick(thickness=2)
        .encode(x=alt.X("start_s:Q", title="since arrival (s)"), y=y, color=color, tooltip=tooltip)
    )
    return sized(alt.layer(bars, ticks), alt.Step(34))


def bars(df: pd.DataFrame, x: str, y: str, x_title: str, y_title: str, color: str | None = None) -> alt.Chart:
    """Horizontal bars of ``x`` per ``y`` (a name, e.g. a request id), longest first. The names are
    drawn whole (vLLM's ids, "cmpl-" and 32 hex digits, were cut to "cmpl-0f3c…"), and the y axis has no
    title: Vega drew it over names that long; ``y_title`` names them in the tooltip."""
    chart = (
        alt.Chart(df)
        .mark_bar()
        .encode(
            x=alt.X(f"{x}:Q", title=x_title),
            y=alt.Y(f"{y}:N", title=None, sort="-x", axis=alt.Axis(labelLimit=360)),
            tooltip=[alt.Tooltip(f"{y}:N", title=y_title), *(c for c in df.columns if c != y)],
            color=alt.Color(f"{color}:N") if color else alt.Undefined,
        )
    )
    return sized(chart, max(120, 18 * len(df)))


def step_fit(points: pd.DataFrame, curves: pd.DataFrame) -> alt.LayerChart | alt.FacetChart:
    """Observed step times (points) against the fitted model's curves at a few depths (lines), in ms."""
    dots = (
        alt.Chart(points)
        .mark_circle(opacity=0.45, size=22)
        .encode(
            x=alt.X("prefill_tokens:Q", title="step prefill (tokens)"),
            y=alt.Y("duration_ms:Q", title="step time (ms)"),
            color=alt.Color(
                "max_prefill_depth:Q", title="chunk depth (tokens)", scale=alt.Scale(scheme="viridis")
            ),
            tooltip=[
                "prefill_tokens:Q",
                "max_prefill_depth:Q",
                "num_decode_reqs:Q",
                alt.Tooltip("duration_ms:Q", format=",.1f"),
                alt.Tooltip("predicted_ms:Q", format=",.1f"),
            ],
        )
    )
    lines = (
        alt.Chart(curves)
        .mark_line(strokeWidth=2)
        .encode(
            x="prefill_tokens:Q",
            y="predicted_ms:Q",
            strokeDash=alt.StrokeDash("curve:N", title="fitted model", legend=alt.Legend(orient="bottom")),
            color=alt.value("#333333"),
            tooltip=["curve:N", "prefill_tokens:Q", alt.Tooltip("predicted_ms:Q", format=",.1f")],
        )
    )
    return sized(alt.layer(dots, lines), 320, "step time: observed (points) vs fitted (lines)")


def residuals(points: pd.DataFrame) -> alt.Chart:
    return sized(
        alt.Chart(points)
        .mark_circle(opacity=0.45, size=18)
        .encode(
            x=alt.X("predicted_ms:Q", title="predicted (ms)"),
            y=alt.Y("duration_ms:Q", title="observed (ms)"),
            tooltip=["prefill_tokens:Q", "max_prefill_depth:Q", "num_decode_reqs:Q"],
        ),
        320,
        "step time: observed vs predicted",
    )


# The dash of a fleet series: a model's mean over its engines solid, their max dashed; an engine drawn on
# its own solid, the rest of a model dotted. Said in the titles: a second legend beside the colours ran
# past the chart's edge.
FLEET_DASH = alt.Scale(domain=["mean", "max", "engine", "rest"], range=[[1, 0], [4, 3], [1, 0], [2, 2]])


def by_model(df: pd.DataFrame, mean: str, top: str, y_title: str, title: str) -> Any:
    """Each model's engines over time: their mean (solid) and max (dashed) of one measure; one legend
    entry per model, whatever the number of engines."""
    long = df[df["kind"] == "model"].melt(
        id_vars=["time", "label", "engines"], value_vars=[mean, top], var_name="stat", value_name="value"
    )
    long["stat"] = long["stat"].map({mean: "mean", top: "max"})
    return sized(
        alt.Chart(long)
        .mark_line(point=True)
        .encode(
            x=TIME_AXIS,
            y=alt.Y("value:Q", title=y_title),
            color=alt.Color("label:N", title="model", legend=alt.Legend(orient="bottom", columns=3)),
            strokeDash=alt.StrokeDash("stat:N", scale=FLEET_DASH, legend=None),
            tooltip=[
                alt.Tooltip("time:T", format="%H:%M:%S"),
                alt.Tooltip("label:N", title="model"),
                "stat:N",
                alt.Tooltip("value:Q", format=",.1f"),
                alt.Tooltip("engines:Q", title="engines"),
            ],
        ),
        200,
        f"{title}: mean (solid), max (dashed)",
    )


def worst_engines(df: pd.DataFrame, field: str, y_title: str, title: str) -> Any:
    """The engines drawn on their own (solid) and the rest of each model (dotted, its max) over time:
    one legend entry per line, a few whatever the fleet's size."""
    shown = df[df["kind"].isin(["engine", "rest"])]
    return sized(
        alt.Chart(shown)
        .mark_line(point=True)
        .encode(
            x=TIME_AXIS,
            y=alt.Y(f"{field}:Q", title=y_title),
            color=alt.Color("label:N", title="engine", legend=alt.Legend(orient="bottom", columns=2)),
            strokeDash=alt.StrokeDash("kind:N", scale=FLEET_DASH, legend=None),
            tooltip=[
                alt.Tooltip("time:T", format="%H:%M:%S"),
                alt.Tooltip("label:N", title="engine"),
                alt.Tooltip(f"{field}:Q", format=",.1f"),
                alt.Tooltip("engines:Q", title="engines"),
            ],
        ),
        220,
        f"{title}, the rest dotted",
    )
