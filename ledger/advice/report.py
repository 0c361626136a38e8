"""Readable text for the CLI: the advice (or the refusal with what the data does say) and the fit."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec

from ledger.advice.answer import (
    AdviceBasis,
    ChunkSizeAdvice,
    DepthRow,
    FitSummary,
    StepWindowSummary,
)
from ledger.advice.profile_answer import ProfileReport
from ledger.records import UNSET


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def _ts(v: float | None) -> str:
    if v is None:
        return "-"
    return datetime.fromtimestamp(v, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def _num(v: float) -> str:
    return f"{v:,.0f}"


def render_fit(fit: FitSummary) -> list[str]:
    covers = fit.covers
    formula = ""
    for c in fit.coefficients:
        v = c.ms_per_unit
        term = f"{abs(v):.3g} ms" + ("" if c.term == "intercept" else f"·{c.term}")
        formula += (
            (f"-{term}" if v < 0 else term) if not formula else (f" - {term}" if v < 0 else f" + {term}")
        )
    lines = [
        "fit:      duration = " + formula,
        f"          R² {fit.r2:.4f}, residual p50 {fit.residual_ms.p50:+.2f} ms, "
        f"p99 {fit.residual_ms.p99:+.2f} ms, cross-validated error {fit.cv_rel_error:.1%}, "
        f"{fit.steps_used} steps",
        f"covers:   prefill {covers.prefill_tokens[0]}-{covers.prefill_tokens[1]} tokens "
        f"({covers.prefill_steps} prefill steps), depth {covers.prefill_depth[0]}-"
        f"{covers.prefill_depth[1]}, decode batch {covers.decode_batch[0]}-{covers.decode_batch[1]}",
    ]
    terms = []
    for s in fit.term_selection:
        if s.cv_rel_error is UNSET or s.r2 is UNSET:
            terms.append(f"{s.term} (no variation)")
            continue
        label = "base" if s.term == "base" else ("+" if s.kept else "not ") + s.term
        terms.append(f"{label} {s.cv_rel_error:.1%} R² {s.r2:.4f}")
    lines.append("terms:    " + "; ".join(terms))
    return lines


def _by_depth(rows: list[DepthRow], smallest: int, unconstrained_chunk: int) -> list[str]:
    head = f"  {'depth':>8}  {'chunk':>7}  {'step p99':>10}  {'prefill tok/s':>13}"
    out = [f"{head}  vs {unconstrained_chunk}-token steps"]
    for r in rows:
        if r.chunk_tokens is None:
            if r.status == "unreachable":
                what = "no prefill fits the target at this depth"
            else:
                what = f"needs ~{r.needed_tokens} tokens, below the smallest step seen ({smallest})"
            out.append(f"  {r.depth:>8}  {what}")
            continue
        cost = 1 - (r.throughput_vs_unconstrained or 0.0)
        capped = " (capped: largest seen)" if r.status == "capped" else ""
        out.append(
            f"  {r.depth:>8}  {r.chunk_tokens:>7}  {_ms(r.predicted_step_p99_ms):>10}  "
            f"{_num(r.prefill_tokens_per_s or 0.0):>13}  -{cost:.0%}{capped}"
        )
    return out


def _header(w: StepWindowSummary | None) -> list[str]:
    if w is None:
        return []
    return [
        f"model {w.model!s} (sources: {', '.join(w.source_ids)}); "
        f"{w.steps_read} steps from {_ts(w.first_step_ts)} to "
        f"{_ts(w.last_step_ts)} UTC" + (" (newest only)" if w.truncated else "")
    ]


def _load(a: AdviceBasis) -> list[str]:
    load, dec, gap = a.load, a.decode_ms, a.between_steps_ms
    seen = load.observed_decode_only_step_ms
    seen_txt = f"; decode-only steps seen: p50 {_ms(seen.p50)}, p99 {_ms(seen.p99)}" if seen else ""
    gap_txt = f" - gap between steps {_ms(gap.p50)}" if gap.steps and gap.p50 >= 0.05 else ""
    return [
        f"load:     decode batch p50 {load.decode_batch_p50}, p99 {load.decode_batch_p99}; "
        f"prefill depth p50 {load.prefill_depth_p50}, p99 {load.prefill_depth_p99}; "
        f"step p99 now {_ms(load.observed_step_p99_ms)}",
        f"decode:   {_ms(dec.at_p50_batch)} at batch {load.decode_batch_p50}, "
        f"{_ms(dec.at_p99_batch)} at batch {load.decode_batch_p99}{seen_txt}",
        f"budget:   {_ms(a.prefill_budget_ms)} of prefill per step (target {a.itl_target_ms:g} ms - "
        f"decode {_ms(dec.at_p99_batch)}{gap_txt}); margin {_ms(a.margin_ms)} ({a.margin_from})",
    ]


def render_advice(a: ChunkSizeAdvice) -> str:
    """The advice as the CLI prints it."""
    s, p, t = a.settings, a.predicted, a.throughput
    covers = a.fit.covers
    lines = [
        f"chunk-size advice for an ITL p99 target of {a.itl_target_ms:g} ms",
        *_header(a.window),
        *_load(a),
        "",
    ]
    lines += [
        f"advice at prefill depth {a.depth}:",
        f"  max_num_batched_tokens        {s.max_num_batched_tokens}",
        f"  long_prefill_token_threshold  {s.long_prefill_token_threshold}   "
        f"(a long prompt leaves {a.arrival_share:.0%} of each step's prefill to arrivals)",
        f"  prefill tokens per step       {a.prefill_tokens_per_step}",
        f"  predicted ITL p99             {_ms(p.itl_p99_ms)} at depth {a.depth}, "
        f"{_ms(p.itl_p99_at_depth_0_ms)} at depth 0",
        f"  prefill throughput            {_num(t.prefill_tokens_per_s or 0.0)} tok/s vs "
        f"{_num(t.unconstrained_tokens_per_s)} tok/s in {t.unconstrained_chunk_tokens}-token steps "
        f"(-{t.cost:.0%}); a long prompt alone: {_num(t.long_prompt_tokens_per_s)} tok/s",
        "",
        "largest prefill per step within the target, by depth:",
        *_by_depth(a.by_depth, covers.prefill_tokens[0], t.unconstrained_chunk_tokens),
        "",
        *render_fit(a.fit),
    ]
    lines += [f"note:     {n}" for n in a.notes]
    return "\n".join(lines)


def render_refusal(body: Mapping[str, Any]) -> str:
    """A refusal (the API's error body): the reason, and whatever the partial advice shows (decode
    time, depths that work)."""
    lines = [f"no advice ({body.get('reason', 'error')}): {body.get('detail')}"]
    if body.get("window"):
        lines += _header(msgspec.convert(body["window"], StepWindowSummary))
    if body.get("advice"):
        a = msgspec.convert(body["advice"], AdviceBasis)
        covers = a.fit.covers
        lines += [*_load(a), "", "largest prefill per step within the target, by depth:"]
        lines += _by_depth(a.by_depth, covers.prefill_tokens[0], covers.prefill_tokens[1])
        lines += ["", *render_fit(a.fit)]
    return "\n".join(lines)


def render_profile(r: ProfileReport) -> str:
    """The measured table of ``chunkledger profile``, the fit, and the advice when asked for."""
    plan = r.plan
    lines = [
        f"profile of {r.model}: {r.steps} steps in {r.wall_s:.1f} s "
        f"(chunks {', '.join(map(str, plan.chunk_sizes))}; depth up to {plan.max_depth}; "
        f"decode batches {', '.join(map(str, plan.decode_batches))})",
        "",
        *_profile_tables(r),
        "",
    ]
    if r.fit is not UNSET:
        lines += render_fit(r.fit)
        if r.fit.cv_rel_error > 0.25:
            lines.append(
                f"note:     steps vary far more than chunk size, depth and batch explain (cross-validated "
                f"error {r.fit.cv_rel_error:.0%}): the machine is probably busy; profile on an idle one"
            )
    elif r.fit_error is not UNSET:
        lines.append(f"no fit ({r.fit_error.reason}): {r.fit_error.detail}")
    if r.ledger is not UNSET:
        sent = r.ledger
        lines.append(f"ledger:   {sent.sent} events sent to {sent.url} as source {sent.source_id}")
    if r.advice is not UNSET:
        a = r.advice
        lines += [
            "",
            f"advice for {a.itl_target_ms:g} ms at depth {a.depth}: "
            f"max_num_batched_tokens {a.settings.max_num_batched_tokens}, "
            f"long_prefill_token_threshold {a.settings.long_prefill_token_threshold} "
            f"(predicted ITL p99 {_ms(a.predicted.itl_p99_ms)})",
        ]
    elif r.advice_error is not UNSET:
        lines += ["", f"no advice ({r.advice_error.reason}): {r.advice_error.detail}"]
    return "\n".join(lines)


def _profile_tables(r: ProfileReport) -> list[str]:
    """The chunk steps' lines over depth, and the decode-only steps."""
    lines = [
        "prefill chunk steps (one chunk next to the decodes; Theil-Sen line over depth):",
        f"  {'chunk':>6}  {'decodes':>7}  {'steps':>5}  {'ms at depth 0':>13}  {'ms per 1k depth':>15}",
    ]
    for c in r.chunks:
        lines.append(
            f"  {c.chunk_tokens:>6}  {c.decode_batch:>7}  {c.steps:>5}  "
            f"{c.ms_at_depth_0:>13.2f}  {c.ms_per_1k_depth:>15.2f}"
        )
    lines += ["", "decode-only steps:", f"  {'decodes':>7}  {'steps':>5}  {'p50':>9}  {'p99':>9}"]
    for d in r.decode:
        lines.append(f"  {d.decode_batch:>7}  {d.steps:>5}  {_ms(d.p50_ms):>9}  {_ms(d.p99_ms):>9}")
    return lines
