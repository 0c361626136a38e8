"""What would fix the what-if's errors against real vLLM: the same prediction (the recorded window's
requests replayed under every configuration's setting, :func:`ledger.whatif.service.pooled_replay`) with
the step cost changed, errors against the same measurements (:mod:`bench.whatif_vllm` prints this).

* ``shipped``: what :func:`ledger.whatif.service.what_if` does: the step-time fit of the window
  (:mod:`ledger.advice.fit`) as the step cost.
* ``work``: the fit's depth term as the whole attention work of a chunk, ``n x (before + n / 2)``
  rather than ``n x before``: the n² / 2 within the chunk (prefill tokens² / prefill requests / 2 per
  step, as the fit's ``prefill_tokens_sq``) is added to ``prefill_depth_tokens`` in the fit's data and
  in every replayed step. A window whose chunks all have one size (a long prompt chunked by the budget)
  cannot tell the within-chunk part from the per-token cost: the plain fit folds it into the per-token
  coefficient, which holds at that size only; an unchunked prompt's one 16k-token step is then
  under-predicted by about c x 16k² / 2.
* ``loop``: every step lasts its fitted time plus the window's median ``interval_s - duration_s``
  over consecutive steps (those with decodes): the engine loop's own time between steps, which the
  fit on ``duration_s`` leaves out and the measured latencies hold.
* ``work+loop``: both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import sqlalchemy as sa

from ledger.advice.fit import fit_step_time
from ledger.advice.terms import StepData
from ledger.records import as_json
from ledger.whatif.cost import fitted_cost
from ledger.whatif.query import WhatIfQuery
from ledger.whatif.service import asked_setting, load_window, pooled_replay, recorded_settings
from ledger.whatif.types import StepCost, StepShape

VARIANTS = ("shipped", "work", "loop", "work+loop")


def aggregate_variants(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The variants of repeated runs as one: every predicted tail and the loop gap the median."""
    from bench.whatif_compare import median_tails

    out = {}
    for v, body in runs[0].items():
        out[v] = {
            "loop_gap_s": float(np.median([r[v]["loop_gap_s"] for r in runs])),
            "predicted": {
                name: median_tails([r[v]["predicted"][name] for r in runs]) for name in body["predicted"]
            },
        }
    return out


def with_work(data: StepData) -> StepData:
    """``data`` with ``prefill_depth_tokens`` as the whole attention work (+ tokens² / 2 per chunk)."""
    tri = data.prefill_tokens**2 / np.maximum(data.num_prefill_reqs, 1.0) / 2.0
    return dataclasses.replace(data, prefill_depth_tokens=data.prefill_depth_tokens + tri)


def work_shape(s: StepShape) -> StepShape:
    """The same change on one replayed step (to the nearest token·depth: the shape holds integers)."""
    tri = s.prefill_tokens**2 / max(s.num_prefill_reqs, 1) / 2.0
    return s._replace(prefill_depth_tokens=round(s.prefill_depth_tokens + tri))


def loop_gap_s(data: StepData) -> float:
    """Median ``interval_s - duration_s`` over steps with decodes (0 when no step has an interval)."""
    gap = data.interval_s - data.duration_s
    gap = gap[(data.num_decode_reqs > 0) & np.isfinite(gap) & (gap >= 0)]
    return float(np.median(gap)) if len(gap) else 0.0


def step_cost(data: StepData, variant: str) -> tuple[StepCost, dict[str, Any]]:
    """The step cost of ``variant`` fitted on ``data``, and what it is made of."""
    work = variant.startswith("work")
    fit = fit_step_time(with_work(data) if work else data)
    base = fitted_cost(fit)
    gap = loop_gap_s(data) if variant.endswith("loop") else 0.0

    def cost(shape: StepShape) -> float:
        return base(work_shape(shape) if work else shape) + gap

    info = {"terms": {c.term: c.value_s for c in fit.coefficients}, "loop_gap_s": gap}
    return cost, info


def predict_variants(
    engine: sa.Engine,
    source_id: str,
    window: tuple[float, float],
    recorded: Mapping[str, Any],
    candidates: Mapping[str, Mapping[str, Any]],
    cut: int,
    variants: Sequence[str] = VARIANTS,
) -> dict[str, Any]:
    """Per variant: the fit and the predicted tails of every candidate (name -> its settings): the
    what-if's window (:func:`ledger.whatif.service.load_window`) and recorded setting, the variant's
    step cost."""
    query = WhatIfQuery(source_id=source_id, since=repr(window[0]), until=repr(window[1]))
    loaded = load_window(engine, query)
    base, _ = recorded_settings(loaded.recorded, recorded)
    out: dict[str, Any] = {}
    for variant in variants:
        cost, info = step_cost(loaded.steps.data, variant)
        tails = {
            name: as_json(
                pooled_replay(loaded.recorded.requests, asked_setting(base, values), cost).summary(cut)
            )
            for name, values in candidates.items()
        }
        out[variant] = {**info, "predicted": tails}
    return out


def render_variants(
    variants: Mapping[str, Any],
    measured: Mapping[str, Mapping[str, Any]],
    tails: Sequence[tuple[str, str]],
    tolerance: float,
    bests: Mapping[str, str | None],
    recorded: str,
) -> list[str]:
    """Per configuration, each variant's relative errors (short TTFT p99 / long TTFT / ITL p99; the
    counts within tolerance leave out ``recorded``, the calibration), and the best configuration each
    predicts (``bests``, with the measured one under ``"measured"``)."""
    names = list(measured)
    head = f"  {'config':19}" + "".join(f" | {v:>22}" for v in variants)
    lines = [
        "what would fix them (bench/whatif_variants.py): errors of short TTFT p99 / long TTFT / ITL p99 "
        "under changed step costs",
        head,
        "  " + "-" * (len(head) - 2),
    ]
    counts = dict.fromkeys(variants, 0)
    for name in names:
        line = f"  {name:19}"
        for v, body in variants.items():
            cells = []
            for key, _ in tails:
                p, m = body["predicted"][name].get(key), measured[name].get(key)
                if p is None or m is None or m <= 0:
                    cells.append("-")
                    continue
                err = p / m - 1.0
                counts[v] += name != recorded and abs(err) <= tolerance
                cells.append(f"{err:+.0%}")
            line += f" | {'/'.join(cells):>22}"
        lines.append(line)
    total = (len(names) - (recorded in names)) * len(tails)
    lines.append(
        "  predictions within "
        + f"{tolerance:.0%}: "
        + ", ".join(f"{v} {counts[v]} of {total}" for v in variants)
        + "; loop gap added: "
        + ", ".join(f"{v} {variants[v]['loop_gap_s'] * 1e3:.2f} ms" for v in variants)
    )
    lines.append(
        "  best predicted: "
        + ", ".join(f"{v} {bests.get(v)}" for v in variants)
        + f"; measured: {bests.get('measured')}"
    )
    return lines
