"""The what-if answer as text: measured vs replayed tails for the recorded setting, then each asked one."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from msgspec import UnsetType

from ledger.whatif.answer import (
    CALIBRATED,
    Calibration,
    CalibrationError,
    Candidate,
    Fit,
    Relative,
    ReplayTails,
    StepNoiseFigures,
    WhatIf,
    WindowFigures,
)

COLUMNS = (
    ("short_ttft_p99_s", "short TTFT p99"),
    ("long_ttft_max_s", "long TTFT"),
    ("ttft_p50_s", "TTFT p50"),
    ("itl_p99_s", "ITL p99"),
    ("e2e_p99_s", "e2e p99"),
)


SHOWN = (  # the recorded settings shown
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "max_num_seqs",
    "num_kv_blocks",
    "block_size",
    "enable_chunked_prefill",
    "policy",
    "admission_reserve",
)


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    v = float(v)
    return f"{v:.2f} s" if v >= 1 else f"{v * 1e3:,.0f} ms" if v >= 0.1 else f"{v * 1e3:.1f} ms"


def _pct(v: float | None) -> str:
    return "" if v is None else f" ({v:+.0%})"


def _row(label: str, tails: ReplayTails, rel: Relative | CalibrationError | None, mark: str = "") -> str:
    cells = [f"{_ms(getattr(tails, k))}{_pct(getattr(rel, k, None))}" for k, _ in COLUMNS]
    return f"{label[:38]:<38} " + " ".join(f"{c:>18}" for c in cells) + f" {tails.preemptions:>8}  {mark}"


def _fit_from(fit: Fit, window: WindowFigures) -> str:
    """Where the fit's steps came from, when not the window's own engines and window."""
    same = sorted(fit.source_ids) == sorted(window.source_ids) and (fit.since, fit.until) == (
        window.since,
        window.until,
    )
    return "" if same or not fit.source_ids else f", on {fit.steps:,} steps of {', '.join(fit.source_ids)}"


def _noise(noise: StepNoiseFigures) -> str:
    """What the replay's step noise was drawn from, in a line."""
    loop = noise.loop_ms
    if not noise.applied or isinstance(loop, UnsetType):
        why = noise.why if isinstance(noise.why, str) else "off"
        return f"step noise: none ({why}): every step at its fitted time, back to back"
    return (
        f"step noise: decode steps x {noise.p50:.2f} (p50) to {noise.p99:.2f} (p99) of their fitted "
        f"time ({noise.decode_steps:,} steps); engine loop before a step {loop.decode.p50:.2f} "
        f"(p50) to {loop.decode.p99:.2f} ms (p99) + {loop.per_first_token:.3f} ms per first "
        "token of the step before; " + ("one draw" if noise.draws == 1 else f"{noise.draws} draws pooled")
    )


def _marks(c: Candidate) -> str:
    marks = [m for m, on in (("frontier", c.frontier), ("best", c.best)) if on]
    if c.meets is not None:
        met = (("itl", c.meets.itl), ("ttft", c.meets.ttft))
        marks += [f"{k} {'met' if ok else 'missed'}" for k, ok in met if not isinstance(ok, UnsetType)]
    if c.extrapolated:
        marks.append("extrapolated")
    return " ".join(marks)


def render_whatif(answer: WhatIf) -> str:
    w, cal = answer.window, answer.calibration
    settings = msgspec.structs.asdict(cal.settings)
    shown = ", ".join(f"{k}={settings[k]}{'*' if k in cal.inferred else ''}" for k in SHOWN)
    long = answer.long_prompt_tokens
    skipped = ""
    if w.skipped:
        parts = ", ".join(f"{k} {v}" for k, v in w.skipped.items())
        skipped = f", {sum(w.skipped.values())} skipped ({parts})"
    lines = [
        f"what-if over model {w.model or '-'}: {w.requests} requests on "
        f"{len(w.source_ids)} engine(s){skipped}",
        f"step time fit: R² {answer.fit.r2:.3f}, cross-validated error {answer.fit.cv_rel_error:.1%}"
        f"{_fit_from(answer.fit, w)}",
        _noise(answer.step_noise),
        f"recorded setting: {shown}  (* inferred from the steps)",
        f"long prompts: >= {long} tokens" if long else "long prompts: none in the window",
        "",
        f"{'':<38} " + " ".join(f"{name:>18}" for _, name in COLUMNS) + f" {'preempt':>8}",
        _row("measured", cal.measured, None),
        _row("recorded, replayed (error)", cal.predicted, cal.error),
    ]
    lines += [_row(c.name, c.predicted, c.relative, _marks(c)) for c in answer.candidates]
    lines += [
        f"{c.name}: outside the step-time fit's data: {'; '.join(c.extrapolated)}"
        for c in answer.candidates
        if c.extrapolated
    ]
    worst = cal.max_error
    lines += [
        "",
        "candidates: predicted tails, in brackets the change from the recorded setting replayed",
        f"calibration: the replayed recorded setting misses the measured tails by at most "
        f"{'-' if worst is None else f'{worst:.0%}'} (allowed {cal.max_error_allowed:.0%})",
    ]
    return "\n".join(lines)


def render_refusal(body: Mapping[str, object]) -> str:
    """The API's error body; with the calibration's figures when that is why."""
    lines = [f"no what-if ({body.get('reason', 'error')}): {body.get('detail', '')}"]
    if isinstance(body.get("calibration"), dict):
        cal = msgspec.convert(body["calibration"], Calibration)
        lines.append("calibration (measured vs the recorded setting replayed):")
        for k in CALIBRATED:
            lines.append(
                f"  {k:<18} measured {_ms(getattr(cal.measured, k)):>10}  "
                f"replayed {_ms(getattr(cal.predicted, k)):>10}{_pct(getattr(cal.error, k))}"
            )
    return "\n".join(lines)
