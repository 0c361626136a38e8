"""Predicted against measured, for :mod:`bench.whatif_vllm`: relative errors, the best configuration, the
medians over repeated runs and the printed table (no vLLM, no database: tests/bench/test_whatif_vllm.py).

A run's evaluation (``ev``) holds one row per configuration with ``predicted_all`` (the what-if's tails
from the recorded configuration's window), ``measured_all`` (the ledger's tails of its own window) and
``self`` (its own window's calibration). :func:`aggregate` turns the evaluations of repeated runs of
the same scene into one of the same shape, each tail the median over the runs, with the spread of the
measured ones (the noise floor any prediction is judged against).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

TAILS = (
    ("short_ttft_p99_s", "short TTFT p99"),
    ("long_ttft_max_s", "long TTFT"),
    ("itl_p99_s", "ITL p99"),
)
TOLERANCE = 0.15


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured - 1; None when either is missing or measured is not positive."""
    if predicted is None or measured is None or measured <= 0:
        return None
    return float(predicted) / float(measured) - 1.0


def compare(
    predicted: Mapping[str, Any], measured: Mapping[str, Any], tolerance: float = TOLERANCE
) -> dict[str, dict[str, Any]]:
    """Per tail of :data:`TAILS`: predicted, measured, relative error and whether it is within tolerance."""
    out = {}
    for key, _ in TAILS:
        err = rel_error(predicted.get(key), measured.get(key))
        out[key] = {
            "predicted": predicted.get(key),
            "measured": measured.get(key),
            "error": err,
            "within": err is not None and abs(err) <= tolerance,
        }
    return out


def best(tails: Mapping[str, Mapping[str, Any]], itl_target_s: float | None) -> str | None:
    """The configuration with the lowest short TTFT p99 among those whose ITL p99 is within the target
    (all of them when the target is None); None when none qualifies."""
    ok = {
        name: t["short_ttft_p99_s"]
        for name, t in tails.items()
        if t.get("short_ttft_p99_s") is not None
        and (itl_target_s is None or (t.get("itl_p99_s") is not None and t["itl_p99_s"] <= itl_target_s))
    }
    return min(ok, key=lambda n: ok[n]) if ok else None


def bests(
    predicted: Mapping[str, Mapping[str, Any]],
    measured: Mapping[str, Mapping[str, Any]],
    itl_target_s: float | None,
) -> dict[str, dict[str, Any]]:
    """The best predicted and measured, with the ITL target (when one is given) and without."""
    out = {}
    for key, target in (("target", itl_target_s), ("no_target", None)):
        if key == "target" and target is None:
            continue
        p, m = best(predicted, target), best(measured, target)
        out[key] = {"predicted": p, "measured": m, "same": p == m}
    return out


def median_tails(runs: Sequence[Mapping[str, Any] | None]) -> dict[str, float | None]:
    """Per tail of :data:`TAILS`, the median over the runs that have it (None when none has)."""
    out: dict[str, float | None] = {}
    for key, _ in TAILS:
        values = [float(r[key]) for r in runs if r and r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def spread(values: Sequence[float | None]) -> float | None:
    """(max - min) / 2 / median of the values given (None with fewer than two)."""
    xs = [float(v) for v in values if v is not None]
    if len(xs) < 2 or statistics.median(xs) <= 0:
        return None
    return (max(xs) - min(xs)) / 2.0 / statistics.median(xs)


def aggregate(
    evs: Sequence[Mapping[str, Any]], tolerance: float, itl_target_s: float | None
) -> dict[str, Any]:
    """One evaluation from those of repeated runs: every tail the median over them (see the module)."""
    first = evs[0]
    rows = []
    for row in first["rows"]:
        same = [r for ev in evs for r in ev["rows"] if r["config"] == row["config"]]
        predicted = median_tails([r["predicted_all"] for r in same])
        measured = median_tails([r["measured_all"] for r in same])
        rows.append(
            {
                **{key: row[key] for key in ("config", "recorded", "settings", "unmodelled")},
                "tails": compare(predicted, measured, tolerance),
                "self": median_tails([r["self"] for r in same]),
                "spread": {key: spread([r["measured_all"].get(key) for r in same]) for key, _ in TAILS},
                "predicted_all": predicted,
                "measured_all": measured,
            }
        )
    return {
        **{key: first[key] for key in ("recorded", "long_prompt_tokens", "itl_target_ms")},
        "tolerance": tolerance,
        "runs": len(evs),
        "fits": [ev["fit"] for ev in evs],
        "rows": rows,
        "best": bests(
            {r["config"]: r["predicted_all"] for r in rows},
            {r["config"]: r["measured_all"] for r in rows},
            itl_target_s,
        ),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}" if value >= 0.1 else f"{value * 1e3:.1f}"


def _err(cell: Mapping[str, Any]) -> str:
    if cell["error"] is None:
        return "-"
    return f"{cell['error']:+.0%} {'ok' if cell['within'] else 'X'}"


def _row(row: Mapping[str, Any]) -> str:
    name = row["config"] + (" (rec)" if row["recorded"] else "")
    line = f"  {name:19}"
    for key, _ in TAILS:
        cell = row["tails"][key]
        noise = row["spread"].get(key)
        line += f" | {_ms(cell['predicted']):>19} {_ms(cell['measured']):>6} "
        line += (
            f"{'' if noise is None else f'±{noise:.0%}':>5} {_err(cell):>9} {_ms(row['self'].get(key)):>6}"
        )
    if row["unmodelled"]:
        line += f"   (not modelled: {', '.join(row['unmodelled'])})"
    return line


def render(ev: Mapping[str, Any]) -> list[str]:
    """The table: per configuration and tail, predicted | measured ± spread | error | self."""
    head = f"  {'config':19}"
    for _, label in TAILS:
        head += f" | {label + ' pred':>19} {'meas':>6} {'':>5} {'error':>9} {'self':>6}"
    lines = [head, "  " + "-" * (len(head) - 2), *(_row(r) for r in ev["rows"])]
    runs = f"medians over {ev['runs']} runs, ± half their measured range; " if ev["runs"] > 1 else ""
    lines.append(
        f"  (ms; {runs}rec: the recorded configuration, its row the calibration; error = predicted / "
        f"measured - 1, ok within {ev['tolerance']:.0%}; self: the configuration replayed with its own "
        f"window's fit; long prompts: >= {ev['long_prompt_tokens']} tokens)"
    )
    cells = [(r["config"], k, r["tails"][k]) for r in ev["rows"] if not r["recorded"] for k, _ in TAILS]
    missed = [
        f"{n} {k.removesuffix('_s')} {c['error']:+.0%}"
        for n, k, c in cells
        if not c["within"] and c["error"] is not None
    ]
    lines.append(
        f"  predictions within {ev['tolerance']:.0%}: {sum(c['within'] for _, _, c in cells)} of {len(cells)}"
        + (f"; missed: {', '.join(missed)}" if missed else "")
    )
    labels = {"target": f"among those with ITL p99 <= {ev['itl_target_ms']:g} ms", "no_target": "of all"}
    for key, b in ev["best"].items():
        lines.append(
            f"  best (lowest short TTFT p99 {labels[key]}): predicted {b['predicted']}, measured "
            f"{b['measured']}: " + ("the same" if b["same"] else "DIFFERENT")
        )
    for k, fit in enumerate(ev["fits"]):
        lines.append(
            f"  the recorded window's step-time fit{f' (run {k + 1})' if ev['runs'] > 1 else ''}: "
            f"{' + '.join(fit['terms'])}; R² {fit['r2']:.3f}, cross-validated relative error "
            f"{fit['cv_rel_error']:.0%}"
        )
    return lines
