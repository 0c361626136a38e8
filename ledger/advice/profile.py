"""``chunkledger profile``: measure step time on the real engine before production traffic does.

The plan (:class:`ProfilePlan`) and what is made of the steps it recorded (:class:`ProfileResult`) are
here; the driver that runs the plan on vLLM with chunkledger's scheduler plugin and records the plugin's
``step`` events is :mod:`engine_hooks.vllm.profile` (its docstring says what runs). The ledger never
loads the engine: the command line runs the one and hands its run to the other
(``ProfileResult.of(plan, run_profile(model, plan))``).

The result is the measured table (per chunk size and decode batch: the step time at depth 0 and its
growth per 1k tokens of depth, as in issue 5; per decode batch: the decode-only step) and the same fit
``chunkledger advise`` makes (``ledger.advice.fit``), plus advice when a target is given.

The engine's budget is ``max(chunk) + max(batch) * decode_prompt_tokens`` so the first step (the
decoders' prefills plus the first chunk) fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine_hooks import events as ev
from engine_hooks.profile_run import Delivery, Phase, ProfileRun
from ledger.advice.advisor import AdviceError, Advisor
from ledger.advice.answer import AdviceQuery
from ledger.advice.fit import FitError, fit_step_time
from ledger.advice.profile_answer import (
    ChunkRow,
    DecodeRow,
    PlanSummary,
    ProfileReport,
    Refused,
    profile_advice,
)
from ledger.advice.terms import StepData
from ledger.records import UNSET


class ProfileError(RuntimeError):
    """The profile cannot run (bad plan, no vLLM, the plugin missing); the message says what to do."""


@dataclass(frozen=True)
class ProfilePlan:
    chunk_sizes: tuple[int, ...] = (256, 512, 1024, 2048)
    max_depth: int = 8192  # deepest chunk start of the long prompts
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_prompt_tokens: int = 16  # prompt length of the decoding requests
    tail_steps: int = 8  # decode-only steps after each long prefill
    repeats: int = 1  # runs of the whole plan (more steps, tighter fit)
    seed: int = 0

    def check(self) -> None:
        problems = []
        if not self.chunk_sizes or min(self.chunk_sizes) < 1:
            problems.append("chunk_sizes: give one or more sizes >= 1")
        elif len(set(self.chunk_sizes)) < 3:
            problems.append("chunk_sizes: the fit needs at least 3 different sizes")
        if self.max_depth < 1:
            problems.append("max_depth: must be >= 1")
        elif self.chunk_sizes and self.max_depth < 2 * max(self.chunk_sizes):
            problems.append(
                f"max_depth ({self.max_depth}) must be at least twice the largest chunk "
                f"({max(self.chunk_sizes)}) so every size runs at 3 or more depths"
            )
        if not self.decode_batches or min(self.decode_batches) < 1:
            problems.append("decode_batches: give one or more batch sizes >= 1")
        elif len(set(self.decode_batches)) < 2:
            problems.append("decode_batches: the fit needs at least 2 different decode batches")
        if self.decode_prompt_tokens < 1 or self.tail_steps < 1 or self.repeats < 1:
            problems.append("decode_prompt_tokens, tail_steps and repeats must be >= 1")
        if problems:
            raise ProfileError("; ".join(problems))

    @property
    def max_num_batched_tokens(self) -> int:
        return max(self.chunk_sizes) + max(self.decode_batches) * self.decode_prompt_tokens

    @property
    def max_model_len(self) -> int:
        return self.max_depth + max(self.chunk_sizes) + 8

    def decode_tokens_for(self, chunk: int) -> int:
        """Output tokens a decoding request needs to outlast the long prompt's prefill, plus the tail."""
        return math.ceil((self.max_depth + chunk) / chunk) + self.tail_steps + 2


@dataclass
class ProfileResult:
    plan: ProfilePlan
    model: str
    steps: list[ev.Step]
    phases: Sequence[Phase]
    source_id: str | None = None
    sent: Delivery | None = None

    @classmethod
    def of(cls, plan: ProfilePlan, run: ProfileRun) -> ProfileResult:
        """The result of ``run``, a run of ``plan`` on the engine."""
        return cls(
            plan=plan,
            model=run.model,
            steps=list(run.steps),
            phases=list(run.phases),
            source_id=run.source_id,
            sent=run.sent,
        )

    def data(self) -> StepData:
        return StepData.from_steps(self.steps)

    def chunk_table(self) -> list[ChunkRow]:
        """Per (chunk, decode batch): step time at depth 0 and per 1k depth, from the long prompt's
        chunk steps (one chunk of exactly T tokens, next to the decodes)."""
        rows = []
        for chunk in sorted(set(self.plan.chunk_sizes)):
            for batch in sorted(set(self.plan.decode_batches)):
                depth, dur = self._chunk_steps(chunk, batch)
                if len(set(depth)) < 2:
                    continue
                slope, base = theil_sen(np.asarray(depth) / 1000.0, np.asarray(dur))
                rows.append(
                    ChunkRow(
                        chunk_tokens=chunk,
                        decode_batch=batch,
                        steps=len(dur),
                        max_depth=int(max(depth)),
                        ms_at_depth_0=float(base),
                        ms_per_1k_depth=float(slope),
                    )
                )
        return rows

    def _chunk_steps(self, chunk: int, batch: int) -> tuple[list[int], list[float]]:
        """(depth, duration ms) of the steps that ran one chunk of exactly ``chunk`` tokens in the phases
        of that chunk size next to ``batch`` decodes."""
        depth, dur = [], []
        for p in self.phases:
            if p.chunk != chunk or p.decodes != batch:
                continue
            for s in self.steps[p.first_step : p.end_step]:
                if s.num_prefill_reqs == 1 and s.prefill_tokens == chunk:
                    depth.append(s.max_prefill_depth)
                    dur.append(s.duration_s * 1e3)
        return depth, dur

    def decode_table(self) -> list[DecodeRow]:
        """Per decode batch: the decode-only steps' time."""
        rows = []
        for batch in sorted(set(self.plan.decode_batches)):
            dur = [
                s.duration_s * 1e3 for s in self.steps if s.prefill_tokens == 0 and s.num_decode_reqs == batch
            ]
            if dur:
                rows.append(
                    DecodeRow(
                        decode_batch=batch,
                        steps=len(dur),
                        p50_ms=float(np.quantile(dur, 0.5)),
                        p99_ms=float(np.quantile(dur, 0.99)),
                    )
                )
        return rows

    def report(self, itl_target_ms: float | None = None) -> ProfileReport:
        """The tables, the fit of the steps and, for ``itl_target_ms``, the advice (or why not)."""
        report = ProfileReport(
            model=self.model,
            source_id=self.source_id,
            plan=PlanSummary(
                chunk_sizes=list(self.plan.chunk_sizes),
                max_depth=self.plan.max_depth,
                decode_batches=list(self.plan.decode_batches),
                repeats=self.plan.repeats,
            ),
            steps=len(self.steps),
            wall_s=sum(p.wall_s for p in self.phases),
            chunks=self.chunk_table(),
            decode=self.decode_table(),
            ledger=self.sent if self.sent is not None else UNSET,
        )
        data = self.data()
        try:
            fit = fit_step_time(data)
        except FitError as exc:
            report.fit_error = Refused(reason=exc.reason, detail=str(exc))
            return report
        report.fit = fit.summary()
        if itl_target_ms is not None:
            try:
                advice = Advisor(data, fit).advise(AdviceQuery(itl_target_ms=itl_target_ms))
                report.advice = profile_advice(advice)
            except AdviceError as exc:
                report.advice_error = Refused(reason=exc.reason, detail=str(exc))
        return report


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of the Theil-Sen line: the median of the pairwise slopes, then the median
    intercept. A few stalled steps (up to ~29%) do not move it, unlike least squares."""
    i, j = np.triu_indices(len(x), k=1)
    dx = x[j] - x[i]
    ok = dx != 0
    slope = float(np.median((y[j] - y[i])[ok] / dx[ok]))
    return slope, float(np.median(y - slope * x))
