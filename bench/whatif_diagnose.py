"""Where the what-if's errors against real vLLM come from (:mod:`bench.whatif_vllm` prints this after its
table), per configuration, from the ledger's ``steps`` of its window:

* **engine loop**: the time between steps that the replay's clock does not have. The step cost is fitted
  on ``duration_s`` (``schedule()`` to the end of ``update_from_output()``); a decode waits for the
  whole ``interval_s`` (end of the previous step to the end of this one), which also holds the engine
  loop's own work (output processing, the bench adding requests). Shown: the p50 of ``interval_s -
  duration_s`` over steps with decodes (consecutive steps) and its share of their intervals.
* **fit vs actual**: the recorded window's step-time fit applied to this configuration's actual steps
  (their real shapes), as actual / fitted over the steps that ran the long prompt, over decode-only
  steps and over the rest: a ratio away from 1 is the fit's transfer error, whatever the scheduling.
* **stalls**: steps that took more than twice the fit's time and 5 ms more (the host descheduled the
  engine: the other processes on the two cores), and the decode ITL p99 three ways (weighted by
  decoding requests, as the ledger's): over ``interval_s`` (what is measured), over ``duration_s``, and
  over the fit's time of the same steps (what a replay of the same schedule would give).
* **long prompt**: its measured TTFT split into the wait before its first step and the span of its
  steps, that span's steps as fitted, and the engine-loop time inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import sqlalchemy as sa

from ledger.advice.fit import StepTimeFit
from ledger.advice.terms import COLUMNS, StepData
from ledger.schema import step_request_ids_sql
from ledger.whatif.query import WhatIfQuery
from ledger.whatif.results import weighted_quantile
from ledger.whatif.service import fit_cost, load_window

STALL_FACTOR, STALL_EXTRA_S = 2.0, 0.005
Window = Callable[[sa.Engine, Mapping[str, Any]], tuple[float, float]]


def _steps(
    engine: sa.Engine, sid: str, since: float, until: float
) -> tuple[StepData, np.ndarray, np.ndarray]:
    """The window's steps of one source in time order: their columns, start times, and which ran the
    long prompt (a request id ending in ``-long``, head_of_line's naming)."""
    cols = ", ".join(COLUMNS)
    sql = sa.text(
        f"SELECT {cols}, ts, {step_request_ids_sql()} FROM steps "
        "WHERE source_id = :s AND ts >= :a AND ts < :b ORDER BY ts"
    )
    with engine.connect() as conn:
        rows = conn.execute(sql, {"s": sid, "a": since, "b": until}).all()
    data = StepData.from_rows([tuple(np.nan if v is None else v for v in r[: len(COLUMNS)]) for r in rows])
    ts = np.array([float(r[len(COLUMNS)]) for r in rows])
    long = np.array([any(str(i).endswith("-long") for i in (r[-1] or ())) for r in rows], dtype=bool)
    return data, ts, long


def _ratio(actual: np.ndarray, fitted: np.ndarray) -> dict[str, Any]:
    """actual / fitted: of the sums (``ratio``) and the median step's (``median``)."""
    if not len(actual):
        return {"n": 0}
    return {
        "n": len(actual),
        "actual_s": float(actual.sum()),
        "fitted_s": float(fitted.sum()),
        "ratio": float(actual.sum() / fitted.sum()) if fitted.sum() > 0 else None,
        "median": float(np.median(actual / fitted)),
    }


def engine_loop(data: StepData) -> dict[str, Any]:
    """interval - duration over consecutive steps (those with decodes)."""
    gap = data.interval_s - data.duration_s
    ok = (data.num_decode_reqs > 0) & np.isfinite(gap) & (gap >= 0)
    if not ok.any():
        return {"n": 0}
    return {
        "n": int(ok.sum()),
        "p50_s": float(np.median(gap[ok])),
        "mean_s": float(gap[ok].mean()),
        "share": float(gap[ok].sum() / data.interval_s[ok].sum()),
    }


def itl_three_ways(data: StepData, fitted: np.ndarray) -> dict[str, Any]:
    """Decode ITL p99 over intervals (measured), durations, and the fit's durations of the same steps."""
    w = data.num_decode_reqs
    ok = (w > 0) & np.isfinite(data.interval_s)
    return {
        "interval_p99_s": weighted_quantile(data.interval_s[ok], w[ok], 0.99),
        "duration_p99_s": weighted_quantile(data.duration_s[ok], w[ok], 0.99),
        "fitted_p99_s": weighted_quantile(fitted[ok], w[ok], 0.99),
    }


def _long_request(engine: sa.Engine, sid: str) -> tuple[float, float] | None:
    """(queued_ts, first_token_ts) of the source's long prompt (head_of_line names it ``...-long``)."""
    sql = sa.text(
        "SELECT queued_ts, first_token_ts FROM requests WHERE engine_source_id = :s "
        "AND request_id LIKE '%-long' AND first_token_ts IS NOT NULL"
    )
    with engine.connect() as conn:
        row = conn.execute(sql, {"s": sid}).first()
    return None if row is None else (float(row[0]), float(row[1]))


def long_prompt(
    data: StepData, ts: np.ndarray, long: np.ndarray, fitted: np.ndarray, times: tuple[float, float] | None
) -> dict[str, Any]:
    """The long prompt's TTFT (queued -> first token): the wait before its first step, then the span of
    its steps up to its first token (as run, as fitted, and the engine loop between them)."""
    if times is None:
        return {}
    queued, first_token = times
    at = np.flatnonzero(long & (ts < first_token))
    if not len(at):
        return {}
    first, last = int(at[0]), int(at[-1])
    span = float(ts[last] + data.duration_s[last] - ts[first])
    inside = slice(first, last + 1)
    busy = float(data.duration_s[inside].sum())
    return {
        "ttft_s": first_token - queued,
        "wait_s": float(ts[first] - queued),
        "span_s": span,
        "steps": last - first + 1,
        "durations_s": busy,
        "fitted_s": float(fitted[inside].sum()),
        "loop_s": span - busy,
    }


def diagnose_one(
    engine: sa.Engine, result: Mapping[str, Any], fit: StepTimeFit, window: Window
) -> dict[str, Any]:
    since, until = window(engine, result)
    data, ts, long = _steps(engine, result["source_id"], since, until)
    fitted = np.maximum(fit.predict(data), 1e-4)
    decode_only = (data.prefill_tokens == 0) & ~long
    rest = ~long & ~decode_only
    stall = data.duration_s > np.maximum(STALL_FACTOR * fitted, fitted + STALL_EXTRA_S)
    return {
        "steps": len(data),
        "loop": engine_loop(data),
        "fit_long": _ratio(data.duration_s[long], fitted[long]),
        "fit_decode_only": _ratio(data.duration_s[decode_only], fitted[decode_only]),
        "fit_other": _ratio(data.duration_s[rest], fitted[rest]),
        "stalls": int(stall.sum()),
        "stall_s": float((data.duration_s[stall] - fitted[stall]).sum()),
        "itl": itl_three_ways(data, fitted),
        "long": long_prompt(data, ts, long, fitted, _long_request(engine, result["source_id"])),
    }


def diagnose(
    engine: sa.Engine, results: list[dict[str, Any]], ev: Mapping[str, Any], window: Window
) -> dict[str, Any]:
    """Per configuration (the recorded window's fit, the what-if's, applied to each): see the module
    docstring."""
    rec = next(r for r in results if r["config"] == ev["recorded"])
    since, until = window(engine, rec)
    query = WhatIfQuery(source_id=rec["source_id"], since=repr(since), until=repr(until), step_noise=False)
    fit = fit_cost(engine, load_window(engine, query), query).fit
    per = {r["config"]: diagnose_one(engine, r, fit, window) for r in results}
    coef = {c.term: c.value_s for c in fit.coefficients}
    return {"fit": coef, "per_config": per}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def render_diagnosis(diag: Mapping[str, Any]) -> list[str]:
    coef = diag["fit"]
    terms = ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in coef.items())
    lines = [
        f"where the errors come from (bench/whatif_diagnose.py; the recorded fit: {terms} per unit)",
        f"  {'config':19} {'steps':>5} | {'loop p50':>8} {'share':>6} | {'fit x: long':>11} {'decode':>6} "
        f"{'other':>6} | {'stalls':>6} {'ms':>6} | {'ITL p99 iv':>10} {'dur':>6} {'fit':>6} | "
        f"{'long: wait':>10} {'span':>6} {'steps':>5} {'dur':>6} {'fit':>6} {'loop':>6}",
    ]
    for name, d in diag["per_config"].items():
        loop = d["loop"]
        lg = d["long"]
        itl = d["itl"]
        line = (
            f"  {name:19} {d['steps']:5d} | {_ms(loop.get('p50_s')):>8} "
            f"{(loop['share'] * 100 if loop.get('share') is not None else float('nan')):5.1f}% | "
            f"{_pct(d['fit_long'].get('ratio')):>11} {_pct(d['fit_decode_only'].get('median')):>6} "
            f"{_pct(d['fit_other'].get('median')):>6} | {d['stalls']:6d} {d['stall_s'] * 1e3:6.0f} | "
            f"{_ms(itl['interval_p99_s']):>10} {_ms(itl['duration_p99_s']):>6} "
            f"{_ms(itl['fitted_p99_s']):>6} | "
        )
        if lg:
            line += (
                f"{lg['wait_s'] * 1e3:10.0f} {lg['span_s'] * 1e3:6.0f} {lg['steps']:5d} "
                f"{lg['durations_s'] * 1e3:6.0f} {lg['fitted_s'] * 1e3:6.0f} {lg['loop_s'] * 1e3:6.0f}"
            )
        lines.append(line)
    lines.append(
        "  (ms; loop: interval - duration of steps with decodes, p50 and share of their time; fit x: "
        "actual / fitted step time: summed over the steps with the long prompt, the median decode-only "
        "and other step; stalls: steps over "
        f"{STALL_FACTOR:g}x the fit and +{STALL_EXTRA_S * 1e3:g} ms, their excess; ITL p99 over intervals "
        "(measured), durations, fitted times; long: queued to its first step, then its steps up to its "
        "first token: span, count, durations, fitted, engine loop between them)"
    )
    return lines
