"""Size the head-of-line scene for the engine at hand, from its measured step costs.

The seed's scene (short requests streaming in, one long prompt arriving among them) only shows what it
is meant to show when the engine keeps up with the shorts on its own and the long prompt is long
enough to hurt. Fixed figures do not travel between machines (a tiny model on a 2-core CPU, a real one
on a GPU), so the bench (``bench/head_of_line.py``) and the demo (``scripts/demo.sh``) first profile
the engine (:mod:`ledger.advice.profile`, a small plan) and size the scene from the fit
(:mod:`ledger.advice.fit`):

* **the short-request rate**: the engine at most ``busy`` (half) busy without the long prompt, counted
  as if every short were served alone: ``rate x (its prefill step + output x a one-decode step)``.
  Batching only lowers the real share, so the bound holds; the bench prints the measured share;
* **the long prompt**: the shortest (rounded up to ``round_to``) whose prefill, predicted chunk by chunk
  at depth, takes at least ``long_prefill_s`` (3 s), capped at ``max_long_tokens``.

:func:`size_scene` is a pure function of a fit; :func:`size_from_profile` fits a profile's steps first
(the bench and the demo run :data:`SIZING_PLAN` on the engine with
:func:`engine_hooks.vllm.profile.run_profile`; the ledger never loads the engine).
"""

from __future__ import annotations

import math
from typing import Any

from ledger.advice.answer import FitSummary
from ledger.advice.fit import StepTimeFit, fit_step_time
from ledger.advice.profile import ProfilePlan, ProfileResult
from ledger.records import Record

# ~30 s on a 2-core CPU with the tiny model: chunks of 64-256 tokens to depth 2k, beside 1 and 4 decodes
SIZING_PLAN = ProfilePlan(chunk_sizes=(64, 128, 256), max_depth=2048, decode_batches=(1, 4), tail_steps=8)


class SceneSize(Record, kw_only=True):
    """The scene for one engine (the bench and the demo print it as JSON and read it back)."""

    short_rps: float  # arrival rate of the shorts
    gap_ms: tuple[float, float]  # uniform gap bounds between shorts (mean 1 / short_rps)
    long_tokens: int
    predicted_long_prefill_s: float  # the long prompt's prefill alone, predicted chunk by chunk
    short_cost_s: float  # engine time one short needs served alone (its prefill + its decodes)
    predicted_busy: float  # short_rps x short_cost_s
    decode_step_s: float  # a step with one decode
    short_prefill_step_s: float  # a step with one short's prefill
    capped: bool  # the long prompt hit max_long_tokens before reaching long_prefill_s

    def describe(self) -> str:
        lines = [
            f"scene sized from the engine's profile: one-decode step {self.decode_step_s * 1e3:.1f} ms, "
            f"a short's prefill step {self.short_prefill_step_s * 1e3:.1f} ms, a short served alone "
            f"{self.short_cost_s * 1e3:.0f} ms",
            f"  shorts at {self.short_rps:.1f}/s (gaps {self.gap_ms[0]:.0f}-{self.gap_ms[1]:.0f} ms): "
            f"the engine at most {self.predicted_busy:.0%} busy without the long prompt",
            f"  long prompt {self.long_tokens} tokens: prefill predicted "
            f"{self.predicted_long_prefill_s:.1f} s"
            + (" (capped at the longest allowed)" if self.capped else ""),
        ]
        return "\n".join(lines)


def prefill_s(fit: StepTimeFit, tokens: int, chunk: int = 256, decodes: int = 0) -> float:
    """Predicted duration of prefilling ``tokens`` in chunks of ``chunk`` (each a step at its depth)."""
    total = 0.0
    depth = 0
    while depth < tokens:
        n = min(chunk, tokens - depth)
        total += float(fit.predict_single(n, depth, decodes))
        depth += n
    return total


def size_scene(
    fit: StepTimeFit,
    *,
    short_prompt: int = 48,
    short_output: int = 16,
    busy: float = 0.5,
    long_prefill_s: float = 3.0,
    min_long_tokens: int = 2000,
    max_long_tokens: int = 32000,
    round_to: int = 1000,
    gap_spread: float = 0.5,
) -> SceneSize:
    """The scene for ``fit`` (see the module docstring). ``gap_spread``: gaps are uniform in
    ``mean x [1 - spread, 1 + spread]``."""
    if not 0 < busy < 1:
        raise ValueError("busy must be in (0, 1)")
    if not 0 <= gap_spread < 1:
        raise ValueError("gap_spread must be in [0, 1)")
    decode = max(float(fit.predict_single(0, 0, 1)), 1e-4)
    prefill = max(float(fit.predict_single(short_prompt, 0, 0)), 1e-4)
    cost = prefill + short_output * decode
    rps = busy / cost
    mean_ms = 1e3 / rps
    tokens = max(min_long_tokens, round_to)
    while tokens < max_long_tokens and prefill_s(fit, tokens) < long_prefill_s:
        tokens += round_to
    tokens = min(tokens, max_long_tokens)
    predicted = prefill_s(fit, tokens)
    return SceneSize(
        short_rps=round(rps, 2),
        gap_ms=(round(mean_ms * (1 - gap_spread), 1), round(mean_ms * (1 + gap_spread), 1)),
        long_tokens=tokens,
        predicted_long_prefill_s=predicted,
        short_cost_s=cost,
        predicted_busy=rps * cost,
        decode_step_s=decode,
        short_prefill_step_s=prefill,
        capped=predicted < long_prefill_s,
    )


class ProfiledScene(Record, kw_only=True):
    """A scene sized from a profile run, with the fit it was sized from and the steps it was fitted on."""

    size: SceneSize
    fit: FitSummary
    steps: int  # steps the profile recorded


def size_from_profile(result: ProfileResult, **size: Any) -> ProfiledScene:
    """The scene for the fit of a profile's steps (``size``: the keyword arguments of
    :func:`size_scene`)."""
    fit = fit_step_time(result.data())
    return ProfiledScene(size=size_scene(fit, **size), fit=fit.summary(), steps=len(result.steps))


def overloaded(ttft_p99_s: float, step_p50_s: float, factor: float = 10.0) -> bool:
    """Whether a baseline's short TTFT p99 is above ``factor`` step times: the queue grew, and ratios
    against it would measure queue growth, not the long prompt."""
    return not math.isfinite(ttft_p99_s) or ttft_p99_s > factor * step_p50_s


__all__ = [
    "SIZING_PLAN",
    "ProfiledScene",
    "SceneSize",
    "overloaded",
    "prefill_s",
    "size_from_profile",
    "size_scene",
]
