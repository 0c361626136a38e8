"""The what-if answer as text: measured vs replayed tails for the recorded setting, then each asked one."""

from __future__ import annotations

from typing import Any

COLUMNS = (
    ("short_ttft_p99_s", "short TTFT p99"),
    ("long_ttft_max_s", "long TTFT"),
    ("ttft_p50_s", "TTFT p50"),
    ("itl_p99_s", "ITL p99"),
    ("e2e_p99_s", "e2e p99"),
)


def _ms(v: Any) -> str:
    if v is None:
        return "-"
    v = float(v)
    return f"{v:.2f} s" if v >= 1 else f"{v * 1e3:,.0f} ms" if v >= 0.1 else f"{v * 1e3:.1f} ms"


def _pct(v: Any) -> str:
    return "" if v is None else f" ({v:+.0%})"


def _row(label: str, tails: dict[str, Any], rel: dict[str, Any] | None, mark: str = "") -> str:
    cells = [f"{_ms(tails.get(k))}{_pct((rel or {}).get(k))}" for k, _ in COLUMNS]
    pre = tails.get("preemptions")
    return (
        f"{label[:38]:<38} "
        + " ".join(f"{c:>18}" for c in cells)
        + f" {pre if pre is not None else '-':>8}  {mark}"
    )


def _fit_from(fit: dict[str, Any], window: dict[str, Any]) -> str:
    """Where the fit's steps came from, when not the window's own engines and window."""
    ids = fit.get("source_ids") or []
    same = sorted(ids) == sorted(window["source_ids"]) and (fit.get("since"), fit.get("until")) == (
        window["since"],
        window["until"],
    )
    return "" if same or not ids else f", on {fit.get('steps', 0):,} steps of {', '.join(ids)}"


def _noise(noise: dict[str, Any] | None) -> str:
    """What the replay's step noise was drawn from, in a line."""
    if not noise or not noise.get("applied"):
        why = (noise or {}).get("why", "off")
        return f"step noise: none ({why}): every step at its fitted time, back to back"
    loop = noise["loop_ms"]
    draws = noise["draws"]
    return (
        f"step noise: decode steps x {noise['p50']:.2f} (p50) to {noise['p99']:.2f} (p99) of their fitted "
        f"time ({noise['decode_steps']:,} steps); engine loop before a step {loop['decode']['p50']:.2f} "
        f"(p50) to {loop['decode']['p99']:.2f} ms (p99) + {loop['per_first_token']:.3f} ms per first "
        "token of the step before; " + ("one draw" if draws == 1 else f"{draws} draws pooled")
    )


def render_whatif(body: dict[str, Any]) -> str:
    w, cal = body["window"], body["calibration"]
    settings = cal["settings"]
    shown = ", ".join(
        f"{k}={settings[k]}{'*' if k in cal['inferred'] else ''}"
        for k in (
            "max_num_batched_tokens",
            "long_prefill_token_threshold",
            "max_num_seqs",
            "num_kv_blocks",
            "block_size",
            "enable_chunked_prefill",
            "policy",
            "admission_reserve",
        )
    )
    long = body.get("long_prompt_tokens")
    skipped = ""
    if w["skipped"]:
        parts = ", ".join(f"{k} {v}" for k, v in w["skipped"].items())
        skipped = f", {sum(w['skipped'].values())} skipped ({parts})"
    lines = [
        f"what-if over model {w['model'] or '-'}: {w['requests']} requests on "
        f"{len(w['source_ids'])} engine(s){skipped}",
        f"step time fit: R² {body['fit']['r2']:.3f}, cross-validated error {body['fit']['cv_rel_error']:.1%}"
        f"{_fit_from(body['fit'], w)}",
        _noise(body.get("step_noise")),
        f"recorded setting: {shown}  (* inferred from the steps)",
        f"long prompts: >= {long} tokens" if long else "long prompts: none in the window",
        "",
        f"{'':<38} " + " ".join(f"{name:>18}" for _, name in COLUMNS) + f" {'preempt':>8}",
        _row("measured", cal["measured"], None),
        _row("recorded, replayed (error)", cal["predicted"], cal["error"]),
    ]
    for c in body["candidates"]:
        marks = [m for m, on in (("frontier", c.get("frontier")), ("best", c.get("best"))) if on]
        meets = c.get("meets")
        if meets:
            marks += [f"{k} {'met' if ok else 'missed'}" for k, ok in meets.items()]
        if c.get("extrapolated"):
            marks.append("extrapolated")
        lines.append(_row(c["name"], c["predicted"], c["relative"], " ".join(marks)))
    for c in body["candidates"]:
        if c.get("extrapolated"):
            lines.append(f"{c['name']}: outside the step-time fit's data: {'; '.join(c['extrapolated'])}")
    worst = cal.get("max_error")
    lines += [
        "",
        "candidates: predicted tails, in brackets the change from the recorded setting replayed",
        f"calibration: the replayed recorded setting misses the measured tails by at most "
        f"{'-' if worst is None else f'{worst:.0%}'} (allowed {cal['max_error_allowed']:.0%})",
    ]
    return "\n".join(lines)


def render_refusal(body: dict[str, Any]) -> str:
    lines = [f"no what-if ({body.get('reason', 'error')}): {body.get('detail', '')}"]
    cal = body.get("calibration")
    if isinstance(cal, dict):
        lines.append("calibration (measured vs the recorded setting replayed):")
        for k, err in cal.get("error", {}).items():
            lines.append(
                f"  {k:<18} measured {_ms(cal['measured'].get(k)):>10}  "
                f"replayed {_ms(cal['predicted'].get(k)):>10}{_pct(err)}"
            )
    return "\n".join(lines)
