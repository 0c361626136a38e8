"""Chunk-size advice for an ITL target, from a step-time fit.

For a decoding request every step is one inter-token gap, so the ITL p99 is the p99 step time of the
steps it decodes in. Given a target:

1. decode time at current load: the predicted decode-only step at the observed p50 and p99 decode
   batch (``num_decode_reqs`` over the window);
2. prefill budget per step = target - decode time at the p99 batch - the gap between steps;
3. the largest prefill chunk T whose predicted step (fit at T tokens, depth D, p99 batch) plus the
   residual p99 (the margin) plus the median gap between steps (``interval_s - duration_s`` of
   steps with decodes: host work a decode also waits for) stays within the target, where D is the
   deepest chunk start seen at p99 (``max_prefill_depth`` over prefill steps) unless the caller
   names a depth. The step is costed as one chunk with every prefill token at depth D: the
   depth term (Σ tokens·depth) of any mix of chunks no deeper than D is at most that; per-chunk
   terms, when the fit keeps them, are costed for one chunk;
4. as vLLM settings: ``max_num_batched_tokens`` = T + p99 decode batch (decodes share the budget);
   ``long_prefill_token_threshold`` = (1 - arrival_share)·T, so that a long prompt being chunked
   leaves part of every step's prefill budget to new arrivals (vLLM schedules running requests
   first; without the threshold a long prompt takes the whole budget and arrivals' TTFT waits for
   it to end — docs/design.md, "Why two knobs").

The margin is the residual p99 of the steps whose prediction lies near the target (half to twice
it) when there are enough of them — step noise is roughly proportional to step time, so the global
residual p99 (dominated by long steps) would overstate it — else the global residual p99.

Refusals (``AdviceError``): the fit's (too little data, degenerate design), a depth outside the data,
a target at or below decode time plus margin, a target that leaves fewer than ``min_chunk`` (64) prefill
tokens per step (the budget would not hold the decode batch plus a useful chunk: a smaller chunk pays
the step's fixed cost for too little work, and vLLM needs ``max_num_batched_tokens >= max_num_seqs``;
the refusal gives the target that would allow one), and a target that needs chunks smaller than any
prefill step in the data at that depth. Chunks larger than the data covers are capped at the largest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ledger.advice.answer import (
    Advice,
    AdviceBasis,
    AdviceLoad,
    AdviceQuery,
    AdvisedSettings,
    BetweenSteps,
    DecodeMs,
    DepthRow,
    Predicted,
    StepMs,
    Throughput,
)
from ledger.advice.fit import StepTimeFit, check_data, fit_step_time
from ledger.advice.terms import StepData
from ledger.records import as_json
from ledger.refusal import Refusal

NOISY_FIT = 0.25  # cross-validated relative error above which the advice says the fit is poor
MARGIN_MIN_STEPS = 50  # steps near the target needed to use their residual p99 as the margin
SETTING_MULTIPLE = 16  # engine settings are rounded down to a multiple of this (vLLM's KV block size)


class AdviceError(Refusal):
    """No advice: ``reason`` is a short code, ``status`` the HTTP status the API answers with."""


@dataclass(frozen=True)
class Load:
    """The observed load the advice is for (quantiles over the window's steps)."""

    decode_batch_p50: int
    decode_batch_p99: int
    prefill_depth_p50: int  # max_prefill_depth over prefill steps
    prefill_depth_p99: int
    kv_usage_p50: float
    kv_usage_p99: float
    decode_only_step_p50_s: float | None  # observed decode-only steps, for comparison with the fit
    decode_only_step_p99_s: float | None
    step_p99_s: float  # observed p99 of every step: today's ITL p99 bound
    gap_p50_s: float  # between consecutive steps with decodes: end-to-end interval minus duration
    gap_p99_s: float  # (host work outside schedule()..update_from_output(): a decode waits for it too)
    gap_steps: int  # steps the gap was measured on (0: no interval data; the gap counts as 0)

    @classmethod
    def of(cls, data: StepData) -> Load:
        pre = data.is_prefill
        dec_only = ~pre & (data.num_decode_reqs > 0)
        depth = data.max_prefill_depth[pre]
        gap = data.interval_s - data.duration_s
        gap = gap[(data.num_decode_reqs > 0) & np.isfinite(gap) & (gap >= 0)]
        return cls(
            gap_p50_s=float(np.quantile(gap, 0.5)) if len(gap) else 0.0,
            gap_p99_s=float(np.quantile(gap, 0.99)) if len(gap) else 0.0,
            gap_steps=len(gap),
            decode_batch_p50=math.ceil(np.quantile(data.num_decode_reqs, 0.5)),
            decode_batch_p99=math.ceil(np.quantile(data.num_decode_reqs, 0.99)),
            prefill_depth_p50=int(np.quantile(depth, 0.5)) if len(depth) else 0,
            prefill_depth_p99=int(np.quantile(depth, 0.99)) if len(depth) else 0,
            kv_usage_p50=float(np.quantile(data.kv_usage, 0.5)),
            kv_usage_p99=float(np.quantile(data.kv_usage, 0.99)),
            decode_only_step_p50_s=float(np.quantile(data.duration_s[dec_only], 0.5))
            if dec_only.any()
            else None,
            decode_only_step_p99_s=float(np.quantile(data.duration_s[dec_only], 0.99))
            if dec_only.any()
            else None,
            step_p99_s=float(np.quantile(data.duration_s, 0.99)),
        )


def _floor_to(value: float, multiple: int) -> int:
    return max(multiple, int(value // multiple) * multiple)


@dataclass(frozen=True)
class DepthAdvice:
    depth: int
    status: str  # ok | capped (the data allows more than it covers) | below_data | unreachable
    chunk_tokens: int | None  # largest prefill tokens per step within the target (None: none)
    needed_tokens: int | None  # below_data: what the fit says would fit (an extrapolation)
    predicted_step_s: float | None  # fit + margin at chunk_tokens
    prefill_tokens_per_s: float | None
    unconstrained_tokens_per_s: float  # at the largest prefill step the data covers, same depth
    throughput_ratio: float | None

    def row(self) -> DepthRow:
        return DepthRow(
            depth=int(self.depth),
            status=self.status,  # type: ignore[arg-type]
            chunk_tokens=self.chunk_tokens,
            needed_tokens=self.needed_tokens,
            predicted_step_p99_ms=None if self.predicted_step_s is None else self.predicted_step_s * 1e3,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            unconstrained_tokens_per_s=self.unconstrained_tokens_per_s,
            throughput_vs_unconstrained=self.throughput_ratio,
        )


@dataclass(frozen=True)
class Budget:
    """The time per step the target leaves, and what every predicted step is charged on top."""

    target_s: float
    decode_p50_s: float  # predicted decode-only step at the p50 and p99 decode batch
    decode_p99_s: float
    margin_s: float  # residual p99 near the target
    margin_from: str
    gap_s: float  # median host time between steps

    @property
    def prefill_s(self) -> float:
        """Prefill budget per step: target - decode time at the p99 batch - the gap between steps."""
        return self.target_s - self.decode_p99_s - self.gap_s

    @property
    def allowance_s(self) -> float:
        """Added to every predicted step: the residual p99 and the gap."""
        return self.margin_s + self.gap_s


class Advisor:
    """Advice from one fit and the load it was fitted on."""

    def __init__(self, data: StepData, fit: StepTimeFit | None = None) -> None:
        self.data = check_data(data)
        self.fit = fit or fit_step_time(self.data)
        self.load = Load.of(self.data)

    # -- pieces ----------------------------------------------------------------------------------
    def _kv(self) -> float:
        """KV usage to predict at: the end of the observed range that makes steps slower."""
        if self.fit.coefficient("kv_usage") >= 0:
            return self.load.kv_usage_p99
        return float(np.quantile(self.data.kv_usage, 0.01))

    def predict_s(self, tokens: Any, depth: float, decodes: float) -> np.ndarray:
        return self.fit.predict_single(tokens, depth, decodes, self._kv())

    def decode_s(self, batch: int) -> float:
        return float(self.predict_s(0.0, 0.0, batch))

    def margin(self, target_s: float) -> tuple[float, str]:
        """Residual p99 near the target (see the module docstring), and where it came from."""
        pred, resid = self.fit.predicted_s, self.fit.residuals_s
        near = (pred >= target_s / 2) & (pred <= target_s * 2)
        if int(near.sum()) >= MARGIN_MIN_STEPS:
            lo, hi = target_s / 2 * 1e3, target_s * 2 * 1e3
            return (
                max(float(np.quantile(resid[near], 0.99)), 0.0),
                f"residual p99 of the {int(near.sum())} steps predicted at {lo:.0f}-{hi:.0f} ms",
            )
        return max(self.fit.residual_p99_s, 0.0), f"residual p99 of all {len(resid)} steps"

    def at_depth(self, depth: int, target_s: float, margin_s: float, batch: int) -> DepthAdvice:
        """The largest prefill tokens per step at ``depth`` whose predicted step + margin fits."""
        t_min, t_max = (int(v) for v in self.fit.ranges.prefill_tokens)
        grid = np.arange(1, t_max + 1, dtype=np.float64)
        step = self.predict_s(grid, depth, batch) + margin_s
        unconstrained = t_max / float(step[-1] - margin_s)
        ok = step <= target_s
        # the longest run of fitting sizes starting at the smallest size the data covers
        run = np.cumprod(ok[t_min - 1 :])
        fits = int(run.sum())
        if fits == 0:
            below = np.flatnonzero(~ok[: t_min - 1])
            needed = int(below[0]) if len(below) else t_min - 1  # sizes 1..needed fit (extrapolated)
            status = "below_data" if needed >= 1 else "unreachable"
            return DepthAdvice(depth, status, None, needed or None, None, None, unconstrained, None)
        chunk = t_min - 1 + fits
        status = "capped" if chunk == t_max else "ok"
        pred = float(step[chunk - 1])
        tput = chunk / (pred - margin_s)
        return DepthAdvice(depth, status, chunk, None, pred, tput, unconstrained, tput / unconstrained)

    # -- the advice, in stages ------------------------------------------------------------------
    def advise(self, query: AdviceQuery) -> Advice:
        """The settings for ``query``'s target (see the module docstring): the budget, the largest
        chunk at each depth, then the settings, or an AdviceError carrying what the data does say."""
        depth = self.advised_depth(query.depth)
        budget = self.budget(query.itl_target_ms / 1e3)
        depths = sorted(
            {0, self.load.prefill_depth_p50, self.load.prefill_depth_p99, self._depth_max(), depth}
        )
        b99 = self.load.decode_batch_p99
        by_depth = {d: self.at_depth(d, budget.target_s, budget.allowance_s, b99) for d in depths}
        basis = self.basis(query.itl_target_ms, budget, depth, [by_depth[d] for d in depths])
        chunk = self.chunk(basis, budget, by_depth[depth], query.min_chunk)
        return self.settings(basis, budget, by_depth, chunk, query.arrival_share)

    def _depth_max(self) -> int:
        return int(self.fit.ranges.max_prefill_depth[1])

    def advised_depth(self, depth: int | None) -> int:
        """The depth to advise at: the p99 seen, or the one asked if the data covers it."""
        d_hi = self._depth_max()
        if depth is None:
            return self.load.prefill_depth_p99
        if not 0 <= depth <= d_hi:
            raise AdviceError(
                "depth_outside_data",
                f"depth={depth} is outside the depths the data covers (0..{d_hi}); the fit would "
                f"extrapolate. Profile deeper prompts (chunkledger profile) or ask within 0..{d_hi}",
                status=422,
                covered=[0, d_hi],
            )
        return depth

    def budget(self, target_s: float) -> Budget:
        margin_s, margin_from = self.margin(target_s)
        return Budget(
            target_s=target_s,
            decode_p50_s=self.decode_s(self.load.decode_batch_p50),
            decode_p99_s=self.decode_s(self.load.decode_batch_p99),
            margin_s=margin_s,
            margin_from=margin_from,
            gap_s=self.load.gap_p50_s,
        )

    def basis(self, itl_target_ms: float, budget: Budget, depth: int, rows: list[DepthAdvice]) -> AdviceBasis:
        """What the advice stands on: the load, decode time, budget, margin, and each depth's chunk."""
        load = self.load
        seen = None
        if load.decode_only_step_p50_s is not None and load.decode_only_step_p99_s is not None:
            seen = StepMs(p50=load.decode_only_step_p50_s * 1e3, p99=load.decode_only_step_p99_s * 1e3)
        return AdviceBasis(
            itl_target_ms=itl_target_ms,
            load=AdviceLoad(
                decode_batch_p50=load.decode_batch_p50,
                decode_batch_p99=load.decode_batch_p99,
                prefill_depth_p50=load.prefill_depth_p50,
                prefill_depth_p99=load.prefill_depth_p99,
                kv_usage_p99=load.kv_usage_p99,
                observed_step_p99_ms=load.step_p99_s * 1e3,
                observed_decode_only_step_ms=seen,
            ),
            decode_ms=DecodeMs(
                at_p50_batch=budget.decode_p50_s * 1e3, at_p99_batch=budget.decode_p99_s * 1e3
            ),
            prefill_budget_ms=budget.prefill_s * 1e3,
            margin_ms=budget.margin_s * 1e3,
            between_steps_ms=BetweenSteps(
                p50=load.gap_p50_s * 1e3, p99=load.gap_p99_s * 1e3, steps=load.gap_steps
            ),
            margin_from=budget.margin_from,
            depth=depth,
            by_depth=[r.row() for r in rows],
            fit=self.fit.summary(),
        )

    def chunk(self, basis: AdviceBasis, budget: Budget, main: DepthAdvice, min_chunk: int) -> int:
        """The advised prefill tokens per step, or the refusal: no prefill fits, the target needs chunks
        smaller than the data covers, or it leaves fewer than ``min_chunk`` tokens."""
        target_ms, depth, b99 = basis.itl_target_ms, basis.depth, self.load.decode_batch_p99
        decode99, gap_s, margin_s = budget.decode_p99_s, budget.gap_s, budget.margin_s
        partial = as_json(basis)
        if budget.prefill_s - margin_s <= 0:
            needed = math.ceil((decode99 + gap_s + margin_s) * 1e3)
            raise AdviceError(
                "target_unreachable",
                f"a {target_ms:g} ms ITL target is at or below decode time at the p99 batch "
                f"({decode99 * 1e3:.1f} ms for {b99} decodes), the gap between steps ({gap_s * 1e3:.1f} ms) "
                f"and the margin ({margin_s * 1e3:.1f} ms): no prefill fits; raise itl_target_ms above "
                f"{needed} ms (more for a useful chunk) or lower the decode batch (max_num_seqs)",
                advice=partial,
                needed_itl_target_ms=needed,
            )
        if main.chunk_tokens is None:
            smallest = int(self.fit.ranges.prefill_tokens[0])
            raise AdviceError(
                "outside_data",
                f"at depth {depth} the target needs prefill steps under {smallest} tokens, smaller than "
                f"any in the data (the fit says about {main.needed_tokens or 0}); profile smaller chunks "
                "at that depth (chunkledger profile) or raise the target",
                advice=partial,
            )
        chunk = main.chunk_tokens
        if chunk < min_chunk:
            need_s = float(self.predict_s(min_chunk, depth, b99)) + budget.allowance_s
            raise AdviceError(
                "chunk_too_small",
                f"at depth {depth} a {target_ms:g} ms ITL target leaves {chunk} prefill tokens per "
                f"step (decode {decode99 * 1e3:.1f} ms for {b99} decodes, margin {margin_s * 1e3:.1f} ms, "
                f"gap {gap_s * 1e3:.1f} ms), fewer than a useful chunk ({min_chunk}): a budget of "
                f"{chunk + b99} tokens could not hold the decode batch and a chunk. Raise itl_target_ms "
                f"to at least {math.ceil(need_s * 1e3)} ms, or lower the decode batch (max_num_seqs)",
                advice=partial,
                needed_itl_target_ms=math.ceil(need_s * 1e3),
                chunk_tokens=chunk,
                min_chunk=min_chunk,
            )
        return chunk

    def settings(
        self,
        basis: AdviceBasis,
        budget: Budget,
        by_depth: dict[int, DepthAdvice],
        chunk: int,
        arrival_share: float,
    ) -> Advice:
        """The engine settings for ``chunk``, what they predict and cost, and the notes."""
        depth, b99 = basis.depth, self.load.decode_batch_p99
        main = by_depth[depth]
        settings = AdvisedSettings(
            max_num_batched_tokens=_floor_to(chunk + b99, SETTING_MULTIPLE),
            long_prefill_token_threshold=_floor_to((1 - arrival_share) * chunk, SETTING_MULTIPLE),
        )
        prefill_share = settings.max_num_batched_tokens - b99
        worst = float(self.predict_s(prefill_share, depth, b99)) + budget.allowance_s
        shallow = float(self.predict_s(prefill_share, 0, b99)) + budget.allowance_s
        threshold = settings.long_prefill_token_threshold
        return Advice(
            **msgspec.structs.asdict(basis),
            prefill_tokens_per_step=chunk,
            settings=settings,
            arrival_share=arrival_share,
            predicted=Predicted(itl_p99_ms=worst * 1e3, itl_p99_at_depth_0_ms=shallow * 1e3),
            throughput=Throughput(
                prefill_tokens_per_s=main.prefill_tokens_per_s,
                unconstrained_tokens_per_s=main.unconstrained_tokens_per_s,
                unconstrained_chunk_tokens=int(self.fit.ranges.prefill_tokens[1]),
                cost=1 - (main.throughput_ratio or 0.0),
                long_prompt_tokens_per_s=threshold / float(self.predict_s(threshold, depth, b99)),
            ),
            notes=self.notes(main, settings, by_depth[self._depth_max()], depth),
        )

    def notes(self, main: DepthAdvice, settings: AdvisedSettings, deep: DepthAdvice, depth: int) -> list[str]:
        """What the reader should know about the advice: capped, a small budget, a poor fit, deep prompts."""
        notes = []
        if main.status == "capped":
            notes.append(
                f"the target allows more than the largest prefill step in the data ({main.chunk_tokens} "
                "tokens); the advice stops there: profile larger chunks to go further"
            )
        if settings.max_num_batched_tokens < 256:
            notes.append("vLLM requires max_num_seqs <= max_num_batched_tokens: lower max_num_seqs too")
        if self.fit.cv_rel_error > NOISY_FIT:
            notes.append(
                f"the fit explains step time poorly (cross-validated error {self.fit.cv_rel_error:.0%}): "
                "steps vary for reasons outside the model (a busy machine, swapping, other tenants); "
                "the margin carries it, so the advice is conservative"
            )
        if deep.status in ("below_data", "unreachable"):
            notes.append(
                f"the deepest chunks seen (depth {self._depth_max()}) cannot meet the target with any chunk "
                "the data covers; they are rarer than p99, so the advice is for depth "
                f"{depth}: expect steps above the target while such prompts prefill"
            )
        return notes


def advise(data: StepData, query: AdviceQuery) -> Advice:
    """Fit ``data`` and advise for ``query`` (see the module docstring)."""
    return Advisor(data).advise(query)
