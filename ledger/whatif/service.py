"""What-if: the window's own traffic replayed under the recorded setting and under the asked ones.

:func:`what_if` answers a :class:`~ledger.whatif.query.WhatIfQuery` with a
:class:`~ledger.whatif.answer.WhatIf` in named stages, which the benches call too:

1. :func:`load_window`: the window's steps and finished requests (:mod:`ledger.whatif.trace`).
2. :func:`fit_cost`: the step cost, from the fit of the window's steps' duration (or another engine's,
   :mod:`ledger.advice.fit`), and the step noise drawn from the window's own spread.
3. :func:`calibrate`: replay the recorded setting and compare its tails with the measured ones; the
   relative error of each is printed next to every prediction, and the answer is refused
   (``calibration_failed``) when the largest is over ``max_error``, unless ``force``.
4. :func:`replay_candidates`: replay each candidate; report its predicted tails, their ratio to the
   recorded setting's predicted tails (the model's bias cancels in it), whether it meets the targets,
   and which candidates are on the frontier (no other is as good on short TTFT p99, long TTFT and ITL
   p99 and better on one).
5. :func:`assemble`: the answer.

The recorded setting is what the caller states (``recorded``), the rest inferred from the window's
steps: the token budget as the most tokens one step ran, ``max_num_seqs`` as the most requests
running, chunked prefill on when a prompt was longer than any step. The KV cache size cannot be read
off the steps: without it, a window with preemptions is refused (``recorded_setting_needed``), one
without is replayed with a KV cache that never runs out.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np
import sqlalchemy as sa

from engine_hooks.scheduling.settings import EngineSettings
from ledger.advice.advisor import AdviceError
from ledger.advice.fit import FitError, StepTimeFit, fit_step_time
from ledger.advice.query import StepWindow, read_steps
from ledger.advice.terms import CANDIDATE_TERMS, TERMS, Term
from ledger.whatif.answer import (
    CALIBRATED,
    METRICS,
    AskedSettings,
    Attention,
    Calibration,
    CalibrationError,
    Candidate,
    Fit,
    LoopTimes,
    Meets,
    Relative,
    ReplayTails,
    Spread,
    StepNoiseFigures,
    Targets,
    WhatIf,
    WhatIfError,
    WindowFigures,
    settings_record,
)
from ledger.whatif.cost import fitted_cost
from ledger.whatif.model import ReplayTimeout, replay
from ledger.whatif.noise import StepNoise, draws_for, window_noise
from ledger.whatif.query import SettingValue, WhatIfQuery, setting_text
from ledger.whatif.results import Replay, ReplaySummary
from ledger.whatif.trace import Recorded, read_recorded
from ledger.whatif.types import StepCost, StepShape, TraceRequest

MIN_REQUESTS = 50  # fewer finished requests in the window: refuse (the tails would be noise)
UNBOUNDED_KV_BLOCKS = 1 << 30  # "the KV cache never ran out" when its size is not known
FRONTIER = ("short_ttft_p99_s", "long_ttft_max_s", "itl_p99_s")  # lower is better on each
EXTRAPOLATION = 1.25  # a replay asking the fit for steps beyond this x what its data covered: flagged


def engine_settings(values: Mapping[str, SettingValue], where: str) -> EngineSettings:
    """The engine settings ``values`` give; a WhatIfError (422) names the setting at fault."""
    try:  # each value's type: parse_setting's (the field's) or checked here by EngineSettings
        return EngineSettings(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        raise WhatIfError("bad_setting", f"{where}: {exc}", status=422) from None


def asked_setting(base: EngineSettings, asked: Mapping[str, SettingValue]) -> EngineSettings:
    """``base`` with the ``asked`` settings changed."""
    return engine_settings({**dataclasses.asdict(base), **asked}, setting_text(asked) or "recorded")


def recorded_settings(
    recorded: Recorded, given: Mapping[str, SettingValue]
) -> tuple[EngineSettings, list[str]]:
    """The recorded setting: ``given`` plus what the window shows (the names inferred are returned)."""
    observed = recorded.observed
    values = dict(given)
    inferred: list[str] = []
    longest = max(
        (r.prompt_tokens - r.cached_tokens for rs in recorded.requests.values() for r in rs), default=0
    )
    if "max_num_batched_tokens" not in values:
        values["max_num_batched_tokens"] = max(observed.max_step_tokens, 1)
        inferred.append("max_num_batched_tokens")
    if "enable_chunked_prefill" not in values:
        values["enable_chunked_prefill"] = longest > int(values["max_num_batched_tokens"])
        inferred.append("enable_chunked_prefill")
    if "max_num_seqs" not in values:
        values["max_num_seqs"] = max(observed.max_running, 1)
        inferred.append("max_num_seqs")
    if "num_kv_blocks" not in values:
        if recorded.preemptions:
            raise WhatIfError(
                "recorded_setting_needed",
                f"the window has {recorded.preemptions} preemptions, so its KV cache ran out, and its size "
                "cannot be read off the steps: give recorded num_kv_blocks (and block_size if not 16)",
                status=422,
            )
        values["num_kv_blocks"] = UNBOUNDED_KV_BLOCKS
        inferred.append("num_kv_blocks")
    return engine_settings(values, "recorded"), inferred


# -- replay over the window's engines -----------------------------------------------------------------
def pooled_replay(
    requests: Mapping[str, Sequence[TraceRequest]],
    settings: EngineSettings,
    cost: StepCost,
    noise: StepNoise | None = None,
    draws: int = 1,
    deadline: float | None = None,
) -> Replay:
    """Each engine's requests through its own scheduler model, the results pooled (engines in the
    order of ``requests``); ``noise``: each step's factor and loop time (:mod:`ledger.whatif.noise`),
    drawn anew (its seed, + 1, ...) in each of ``draws`` replays, pooled one after the other."""
    if draws < 1 or (draws > 1 and noise is None):
        raise ValueError(f"draws must be 1, or more with step noise (got {draws})")
    parts = []
    bs = settings.block_size
    # a prefix hit counts in whole blocks of the replayed block size
    blocked = {
        sid: [
            r
            if r.cached_tokens % bs == 0
            else replace(r, cached_tokens=r.cached_tokens - r.cached_tokens % bs)
            for r in reqs
        ]
        for sid, reqs in requests.items()
    }
    for draw in range(draws):
        drawn = noise.reseeded(noise.seed + draw) if noise is not None else None
        for sid, reqs in blocked.items():
            try:
                parts.append(replay(reqs, settings, cost, noise=drawn, deadline=deadline))
            except ValueError as exc:
                raise WhatIfError("cannot_replay", f"engine {sid}: {exc}", status=422) from None
            except ReplayTimeout:
                raise WhatIfError(
                    "timeout",
                    "the replays did not finish within the what-if time limit (whatif_timeout_s); ask "
                    "for fewer settings or a shorter window",
                    status=408,
                    limit="whatif_timeout_s",
                ) from None
    return Replay(
        request_id=[i for p in parts for i in p.request_id],
        prompt_tokens=np.concatenate([p.prompt_tokens for p in parts]),
        ttft_s=np.concatenate([p.ttft_s for p in parts]),
        e2e_s=np.concatenate([p.e2e_s for p in parts]),
        preemptions=np.concatenate([p.preemptions for p in parts]),
        itl_gap_s=np.concatenate([p.itl_gap_s for p in parts]),
        itl_count=np.concatenate([p.itl_count for p in parts]),
        steps=sum(p.steps for p in parts),
        simulated_s=max(p.simulated_s for p in parts),
        draws=draws,
    )


class Coverage:
    """A step cost that remembers the largest step shapes it was asked for, to tell a prediction
    inside the fit's data from one outside it (a 16k-token chunk from a fit that saw 2k ones)."""

    def __init__(self, cost: StepCost) -> None:
        self._cost = cost
        self.prefill_tokens = 0
        self.max_prefill_depth = 0
        self.num_decode_reqs = 0

    def __call__(self, shape: StepShape) -> float:
        if shape.prefill_tokens > self.prefill_tokens:
            self.prefill_tokens = shape.prefill_tokens
        if shape.max_prefill_depth > self.max_prefill_depth:
            self.max_prefill_depth = shape.max_prefill_depth
        if shape.num_decode_reqs > self.num_decode_reqs:
            self.num_decode_reqs = shape.num_decode_reqs
        return self._cost(shape)

    def outside(self, fit: StepTimeFit, attention: StepTimeFit | None = None) -> list[str]:
        """What the replay asked of the fit beyond EXTRAPOLATION x what the fit's steps covered (and,
        for the prefill's size and depth, the steps ``attention``, the in-chunk term's fit, covered)."""
        r = fit.ranges
        tokens, depth = r.prefill_tokens[1], r.max_prefill_depth[1]
        if attention is not None:
            tokens = max(tokens, attention.ranges.prefill_tokens[1])
            depth = max(depth, attention.ranges.max_prefill_depth[1])
        out = []
        for name, asked, covered in (
            ("prefill tokens per step", self.prefill_tokens, tokens),
            ("prefill depth", self.max_prefill_depth, depth),
            ("decoding requests per step", self.num_decode_reqs, r.num_decode_reqs[1]),
        ):
            if asked > EXTRAPOLATION * max(covered, 1):
                out.append(f"{name} up to {asked:,} (the fit's steps: up to {int(covered):,})")
        return out


_SQ = TERMS["prefill_tokens_sq"]


def _attention_term(
    engine: sa.Engine, source_id: str | None, now: float | None
) -> tuple[StepTimeFit | None, float]:
    """The fit of ``source_id``'s steps and its in-chunk attention coefficient (s per token²); (None,
    0) without a source. Refused when those steps do not show it."""
    if source_id is None:
        return None, 0.0
    try:
        steps = read_steps(engine, model=None, source_id=source_id, since=None, until=None, now=now)
        fit = fit_step_time(steps.data)
    except AdviceError as exc:
        raise WhatIfError(exc.reason, f"attention_source: {exc}", status=exc.status, **exc.details) from None
    except FitError as exc:
        raise WhatIfError(
            exc.reason, f"attention_source: cannot fit {source_id}'s steps: {exc}", status=409
        ) from None
    value = {c.term: c.value_s for c in fit.coefficients}.get(_SQ.name)
    if value is None or value <= 0:
        raise WhatIfError(
            "attention_not_measured",
            f"attention_source: the steps of {source_id!r} do not show attention inside a chunk (the fit "
            "kept no tokens² term): profile larger chunk sizes (chunkledger profile --chunk-sizes "
            "256,1024,4096,8192,16384 --max-depth 32768)",
            status=409,
            terms=list(fit.terms),
        )
    return fit, value


def _plus_attention(cost: StepCost, per_token2: float) -> StepCost:
    """``cost`` plus the in-chunk attention: ``per_token2`` x tokens² per chunk."""

    def with_attention(shape: StepShape) -> float:
        return cost(shape) + per_token2 * float(shape.prefill_tokens) ** 2 / max(shape.num_prefill_reqs, 1)

    return with_attention


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured <= 0:
        return None
    return float(predicted) / float(measured) - 1.0


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def default_long_prompt(recorded: Recorded) -> int | None:
    """Prompts of at least 8x the median (and 1,024 tokens) are the long ones; None when there are none."""
    if not recorded.count:
        return None
    cut = max(1024, int(8 * float(np.median(recorded.prompt_tokens))))
    return cut if bool((recorded.prompt_tokens >= cut).any()) else None


def tails(summary: ReplaySummary) -> ReplayTails:
    """A summary's tails (:meth:`ledger.whatif.results.Replay.summary` or the measured ones) as the
    answer shows them."""
    return ReplayTails(
        **{k: _num(getattr(summary, k)) for k in METRICS},
        preemptions=int(summary.preemptions),
        requests=int(summary.requests),
    )


# -- 1. the window ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceWindow:
    """The window read: its steps (with each one's predecessor's prefills) and its finished requests."""

    steps: StepWindow
    recorded: Recorded

    def figures(self) -> WindowFigures:
        rec = self.recorded
        return WindowFigures(
            model=self.steps.model,
            source_ids=sorted(rec.requests),
            since=self.steps.since,
            until=self.steps.until,
            requests=rec.count,
            skipped=dict(rec.skipped),
            observed=rec.observed,
        )


def load_window(engine: sa.Engine, query: WhatIfQuery, *, now: float | None = None) -> TraceWindow:
    """The steps and finished requests of the query's model (or engine) in [since, until)."""
    try:
        steps = read_steps(
            engine,
            model=query.model,
            source_id=query.source_id,
            since=query.since,
            until=query.until,
            now=now,
            previous_prefills=True,
        )
    except AdviceError as exc:
        raise WhatIfError(exc.reason, str(exc), status=exc.status, **exc.details) from None
    with engine.connect() as conn:
        rec = read_recorded(
            conn, model=steps.model, source_ids=steps.source_ids, since=steps.since, until=steps.until
        )
    return TraceWindow(steps=steps, recorded=rec)


# -- 2. the step cost ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Costing:
    """What a replayed step costs: the fit (``fit_steps``: the steps it was fitted on), with the
    attention inside a chunk fitted on another engine's steps (``attention``, ``in_chunk`` s per
    token²) if asked, and the step noise drawn in ``draws`` replays (None: off, or too few steps)."""

    fit: StepTimeFit
    fit_steps: StepWindow
    cost: StepCost
    attention: StepTimeFit | None
    attention_source: str | None
    in_chunk: float
    noise: StepNoise | None
    noise_asked: bool
    draws: int

    def figures(self) -> Fit:
        att = self.attention
        return Fit(
            r2=float(self.fit.r2),
            cv_rel_error=float(self.fit.cv_rel_error),
            terms=list(self.fit.terms),
            source_ids=list(self.fit_steps.source_ids),
            since=self.fit_steps.since,
            until=self.fit_steps.until,
            steps=len(self.fit_steps.data),
            attention=None
            if att is None or self.attention_source is None
            else Attention(
                source_id=self.attention_source,
                ms_per_token2_per_chunk=self.in_chunk * 1e3,
                steps=att.ranges.steps,
                prefill_tokens=[float(x) for x in att.ranges.prefill_tokens],
            ),
        )

    def noise_figures(self) -> StepNoiseFigures:
        """What the replay's step noise was drawn from: the window's decode-only steps' ``actual /
        fitted`` and the engine loop's time before its steps (ms); how many replays with it were pooled."""
        noise = self.noise
        if noise is None:
            return StepNoiseFigures(
                applied=False, why="off" if not self.noise_asked else "too few steps in the window"
            )
        r = np.asarray(noise.ratios)

        def ms(values: list[float]) -> Spread:
            v = np.asarray(values) * 1e3
            q50, q99 = np.quantile(v, [0.5, 0.99])
            return Spread(p50=float(q50), p99=float(q99), mean=float(v.mean()))

        return StepNoiseFigures(
            applied=True,
            draws=self.draws,
            decode_steps=len(r),
            mean=float(r.mean()),
            p50=float(np.quantile(r, 0.5)),
            p99=float(np.quantile(r, 0.99)),
            loop_ms=LoopTimes(
                decode=ms(noise.decode_gaps),
                prefill=ms(noise.prefill_gaps),
                per_first_token=noise.per_first_token * 1e3,
            ),
        )


def _fit_steps(engine: sa.Engine, window: TraceWindow, query: WhatIfQuery, now: float | None) -> StepWindow:
    """The steps the step time is fitted on: the window's, or (``fit_source``, ``fit_since``,
    ``fit_until``) one engine's over all its steps unless a fit window is given, or the window's own
    engines over another window."""
    if query.fit_source is None and query.fit_since is None and query.fit_until is None:
        return window.steps
    by_source = query.fit_source is not None
    try:
        return read_steps(
            engine,
            model=None if by_source else query.model,
            source_id=query.fit_source if by_source else query.source_id,
            since=query.fit_since if query.fit_since is not None or by_source else query.since,
            until=query.fit_until if query.fit_until is not None or by_source else query.until,
            now=now,
        )
    except AdviceError as exc:
        raise WhatIfError(exc.reason, str(exc), status=exc.status, **exc.details) from None


def fit_cost(
    engine: sa.Engine, window: TraceWindow, query: WhatIfQuery, *, now: float | None = None
) -> Costing:
    """The replay's step cost (:class:`Costing`; :func:`what_if` says what the query's fit options do)."""
    fit_steps = _fit_steps(engine, window, query, now)
    attention, in_chunk = _attention_term(engine, query.attention_source, now)
    data = fit_steps.data
    terms: tuple[Term, ...] = CANDIDATE_TERMS
    if attention is not None:
        # the window's steps less the in-chunk attention the other engine measured; the rest fitted here
        data = dataclasses.replace(data, duration_s=data.duration_s - in_chunk * _SQ.column(data))
        terms = tuple(t for t in CANDIDATE_TERMS if t is not _SQ)
    try:
        fit: StepTimeFit = fit_step_time(data, candidates=terms)
    except FitError as exc:
        raise WhatIfError(exc.reason, f"cannot fit the step time: {exc}", status=409, **exc.details) from None
    cost = fitted_cost(fit)
    if attention is not None:
        cost = _plus_attention(cost, in_chunk)
    steps = window.steps
    noise = window_noise(fit, steps.data, prev_prefills=steps.prev_prefill_reqs) if query.step_noise else None
    return Costing(
        fit=fit,
        fit_steps=fit_steps,
        cost=cost,
        attention=attention,
        attention_source=query.attention_source,
        in_chunk=in_chunk,
        noise=noise,
        noise_asked=query.step_noise,
        draws=draws_for(window.recorded.count) if noise is not None else 1,
    )


# -- 3. the calibration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibrated:
    """The recorded setting (``base``) replayed: its summary (``predicted``) and the calibration record;
    ``long_tokens``: the prompt length from which a prompt is a long one."""

    base: EngineSettings
    long_tokens: int | None
    predicted: ReplaySummary
    record: Calibration


def calibrate(
    window: TraceWindow,
    costing: Costing,
    query: WhatIfQuery,
    recorded: Mapping[str, SettingValue] | None = None,
    *,
    deadline: float | None = None,
    min_requests: int = MIN_REQUESTS,
) -> Calibrated:
    """Replay the recorded setting (``recorded``, default the query's, the rest inferred) and compare
    with the measured tails; refused with too few requests, or an error over ``max_error`` unless
    ``force``."""
    rec = window.recorded
    if rec.count < min_requests:
        raise WhatIfError(
            "too_little_data",
            f"the window holds {rec.count} finished requests; a replay needs at least {min_requests}",
            window=msgspec.to_builtins(window.figures()),
        )
    given = query.recorded_values() if recorded is None else recorded
    base, inferred = recorded_settings(rec, given)
    long_tokens = (
        query.long_prompt_tokens if query.long_prompt_tokens is not None else default_long_prompt(rec)
    )
    measured = rec.summary(long_tokens)
    predicted = replay_setting(window, costing, base, deadline=deadline).summary(long_tokens)
    error = {k: _rel(getattr(predicted, k), getattr(measured, k)) for k in CALIBRATED}
    worst = max((abs(v) for v in error.values() if v is not None), default=None)
    record = Calibration(
        settings=settings_record(base),
        inferred=inferred,
        measured=tails(measured),
        predicted=tails(predicted),
        error=CalibrationError(**error),
        max_error=worst,
        max_error_allowed=query.max_error,
    )
    if worst is not None and worst > query.max_error and not query.force:
        raise WhatIfError(
            "calibration_failed",
            f"replaying the recorded setting misses a measured tail by {worst:.0%} (more than "
            f"{query.max_error:.0%}): the model does not describe this window; state the recorded settings "
            "(recorded=...) or pass force",
            status=409,
            window=msgspec.to_builtins(window.figures()),
            calibration=msgspec.to_builtins(record),
        )
    return Calibrated(base=base, long_tokens=long_tokens, predicted=predicted, record=record)


def replay_setting(
    window: TraceWindow,
    costing: Costing,
    settings: EngineSettings,
    *,
    cost: StepCost | None = None,
    deadline: float | None = None,
) -> Replay:
    """The window's requests replayed under ``settings`` with the costing's step cost (or ``cost``),
    its noise and draws."""
    step_cost = costing.cost if cost is None else cost
    return pooled_replay(
        window.recorded.requests, settings, step_cost, costing.noise, costing.draws, deadline
    )


# -- 4. the candidates --------------------------------------------------------------------------------
def replay_candidates(
    window: TraceWindow,
    costing: Costing,
    calibrated: Calibrated,
    candidates: Sequence[Mapping[str, SettingValue]],
    query: WhatIfQuery,
    *,
    deadline: float | None = None,
) -> list[Candidate]:
    """Each asked setting replayed (the recorded one's other settings kept), marked against the targets,
    the frontier (the recorded setting replayed among the others) and the best."""
    rows = []
    for asked in candidates:
        settings = asked_setting(calibrated.base, asked)
        coverage = Coverage(costing.cost)
        summary = replay_setting(window, costing, settings, cost=coverage, deadline=deadline).summary(
            calibrated.long_tokens
        )
        rows.append(
            Candidate(
                name=setting_text(asked) or "recorded",
                set=AskedSettings(**asked),
                settings=settings_record(settings),
                predicted=tails(summary),
                relative=Relative(
                    **{k: _rel(getattr(summary, k), getattr(calibrated.predicted, k)) for k in METRICS}
                ),
                meets=_meets(summary, query.itl_target_ms, query.ttft_target_ms),
                extrapolated=coverage.outside(costing.fit, costing.attention),
                frontier=False,
                best=False,
            )
        )
    everyone = [calibrated.record.predicted, *(r.predicted for r in rows)]
    for row in rows:
        row.frontier = not any(_dominates(o, row.predicted) for o in everyone if o is not row.predicted)
    _mark_best(rows, calibrated.record.predicted)
    return rows


def _dominates(a: ReplayTails, b: ReplayTails) -> bool:
    pairs = [(getattr(a, k), getattr(b, k)) for k in FRONTIER]
    keys = [(x, y) for x, y in pairs if x is not None and y is not None]
    return bool(keys) and all(x <= y for x, y in keys) and any(x < y for x, y in keys)


def _meets(summary: ReplaySummary, itl_ms: float | None, ttft_ms: float | None) -> Meets | None:
    out: dict[str, bool] = {}
    if itl_ms is not None and summary.itl_p99_s is not None:
        out["itl"] = summary.itl_p99_s * 1e3 <= itl_ms
    ttft = summary.short_ttft_p99_s or summary.ttft_p99_s
    if ttft_ms is not None and ttft is not None:
        out["ttft"] = ttft * 1e3 <= ttft_ms
    return Meets(**out) if out else None


def _mark_best(rows: list[Candidate], recorded: ReplayTails) -> None:
    """``best``: among the candidates that meet every target given and stay inside the fit's data, the
    lowest short TTFT p99 (TTFT p99 when there are no long prompts)."""
    key = "short_ttft_p99_s" if recorded.short_ttft_p99_s is not None else "ttft_p99_s"

    def met(r: Candidate) -> bool:
        return r.meets is None or all(
            v is True for v in (r.meets.itl, r.meets.ttft) if v is not msgspec.UNSET
        )

    ok = [r for r in rows if getattr(r.predicted, key) is not None and met(r) and not r.extrapolated]
    best = min(ok, key=lambda r: getattr(r.predicted, key), default=None)
    for r in rows:
        r.best = r is best


# -- 5. the answer ------------------------------------------------------------------------------------
def assemble(
    window: TraceWindow,
    costing: Costing,
    calibrated: Calibrated,
    candidates: list[Candidate],
    query: WhatIfQuery,
    elapsed_s: float,
) -> WhatIf:
    return WhatIf(
        window=window.figures(),
        fit=costing.figures(),
        step_noise=costing.noise_figures(),
        long_prompt_tokens=calibrated.long_tokens,
        targets=Targets(itl_p99_ms=query.itl_target_ms, short_ttft_p99_ms=query.ttft_target_ms),
        calibration=calibrated.record,
        candidates=candidates,
        elapsed_s=elapsed_s,
    )


def what_if(
    engine: sa.Engine,
    query: WhatIfQuery,
    *,
    candidates: Sequence[Mapping[str, SettingValue]] | None = None,
    now: float | None = None,
    timeout_s: float | None = None,
    min_requests: int = MIN_REQUESTS,
) -> WhatIf:
    """The what-if answer (the module docstring says what it holds); WhatIfError when there is none.

    ``candidates``: the settings to replay, parsed (default: the query's ``set``, ``sweep`` and
    ``policy``, refused when they ask none; ``[]``: the calibration alone).

    ``fit_source`` / ``fit_since`` / ``fit_until``: fit the step time on other steps than the
    window's: one engine's (e.g. a ``chunkledger profile`` run sent to the ledger, which measures
    chunk sizes x depths x decode batches: a window that ran one chunk size cannot tell a per-chunk
    cost from a per-token one), over all its steps unless a fit window is given; or the window's own
    engines over another window. ``attention_source``: the one cost a window of one chunk size cannot
    show, the attention inside a chunk (tokens² per chunk), fitted on that engine's steps (a profile
    over chunk sizes), the rest on the window's steps at the window's own level; what a one-step 16k
    prefill costs is then known though the window never ran one. ``step_noise``: each replayed
    decode-only step's fitted time times a factor drawn from the window's own decode-only steps'
    ``actual / fitted``, and each step that follows another the engine loop's time the window measured
    before such a step (:mod:`ledger.whatif.noise`): the ITL tail comes from the steps that ran long. A
    small window is replayed several times with the noise drawn anew and the draws pooled
    (:func:`ledger.whatif.noise.draws_for`), so that its tails do not rest on one draw. ``timeout_s``:
    the replays stop past it (WhatIfError ``timeout``, 408)."""
    t0 = time.perf_counter()
    query = query.checked()
    asked = query.candidates() if candidates is None else list(candidates)
    recorded = query.recorded_values()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    window = load_window(engine, query, now=now)
    costing = fit_cost(engine, window, query, now=now)
    calibrated = calibrate(window, costing, query, recorded, deadline=deadline, min_requests=min_requests)
    rows = replay_candidates(window, costing, calibrated, asked, query, deadline=deadline)
    return assemble(window, costing, calibrated, rows, query, time.perf_counter() - t0)
