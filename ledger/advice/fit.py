"""Step-time model: least squares over ``steps`` rows.

The base model (docs/design.md, "Chunk-size advice") is

    duration ≈ a + b·prefill_tokens + c·prefill_depth_tokens + d·num_decode_reqs

where ``prefill_depth_tokens`` = Σ tokens·computed_before over the step's chunks: attention makes a
chunk's cost grow with how deep into its prompt it starts. Candidate terms are added one at a time
(forward selection) when they lower the cross-validated relative error by ``MIN_CV_GAIN``; every
candidate's figures are kept in ``StepTimeFit.selection`` so the choice can be checked:

* ``num_prefill_reqs``  a fixed cost per prefill chunk (kernel launches, metadata, sampling setup);
* ``max_prefill_depth`` a cost per token of depth that does not scale with the chunk (reading the
  prefix's KV once per chunk); exact for one-chunk steps, the deepest chunk otherwise;
* ``prefill_tokens_sq`` within-chunk attention (tokens² per chunk; per step estimated as
  prefill_tokens² / num_prefill_reqs, exact for one-chunk steps);
* ``kv_usage``          decode attention over the KV in use (grows with the context being decoded).

A candidate is kept on either of two cross-validated errors: the relative error of a step (each step
counts alike, each held-out error capped so that stalls do not decide), or the error in time (each
step weighted by its duration, uncapped). The first is what the advice needs among short steps; the
second sees a term that only long steps show, such as the attention inside a 16k-token chunk. Capped,
the few long steps' misfit looked like stalls and the term was never kept, though a profile over chunk
sizes shows it plainly (in one: the error in time 22 % lower with it, the relative error 1 %).

The fit is weighted least squares (weights 1/ŷ²: step noise is proportional to step time) made robust
with Huber weights, so rare stalls do not bend the coefficients; the residual quantiles reported (and
used as the advice's margin) are over every step, stalls included.

Units: the fit runs in seconds; reports are in milliseconds. Columns are scaled before solving so
that tokens·depth (~10^8) and kv_usage (~1) do not ruin the conditioning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ledger.advice.answer import CoefficientRow, Covers, FitSummary, Residuals, TermChoice
from ledger.advice.regression import (
    CV_CLIP,
    CV_FOLDS,
    column_scale,
    cv_error,
    huber_weights,
    in_sample,
    robust_scale,
    robust_solve,
    weighted_solve,
)
from ledger.advice.terms import BASE_TERMS, CANDIDATE_TERMS, TERMS, StepData, Term

MIN_STEPS = 100  # fewer steps than this: refuse
MIN_PREFILL_STEPS = 30  # steps that ran a prefill chunk
MIN_PREFILL_SIZES = 3  # distinct prefill token counts (the fit extrapolates between them)
MIN_DEPTHS = 3  # distinct chunk depths among prefill steps
STEPS_PER_TERM = 10  # at least this many steps per fitted coefficient (candidates stop short of it)
MIN_CV_GAIN = 0.02  # a candidate term must cut the cross-validated error by 2% (relative) to be kept
MIN_TIME_GAIN = 0.10  # ... or the cross-validated error in time (steps weighted by duration) by 10%
MIN_CV_GAIN_ABS = 1e-4  # ... and by 0.01 percentage points (noise-free data: no rounding-error terms)
SELECTION_MAX_STEPS = 20_000  # term selection runs on a sample of at most this many steps


class FitError(ValueError):
    """The data cannot support a fit. ``reason`` is a short code for clients, the message explains."""

    def __init__(self, reason: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.details = details


@dataclass(frozen=True)
class Coefficient:
    term: str
    value_s: float  # seconds per unit of the term
    stderr_s: float

    def row(self) -> CoefficientRow:
        t = TERMS[self.term]
        return CoefficientRow(
            term=self.term,
            meaning=t.doc,
            ms_per_unit=float(self.value_s * 1e3),
            unit=t.unit,
            stderr_ms=float(self.stderr_s * 1e3),
        )


@dataclass(frozen=True)
class Ranges:
    """What the data covers; advice outside it is extrapolation and is refused or capped."""

    steps: int
    prefill_steps: int
    decode_only_steps: int
    prefill_tokens: tuple[float, float]  # min, max over prefill steps
    max_prefill_depth: tuple[float, float]  # min, max over prefill steps
    num_decode_reqs: tuple[float, float]  # min, max over all steps
    duration_s: tuple[float, float]

    @classmethod
    def of(cls, data: StepData) -> Ranges:
        pre = data.is_prefill
        return cls(
            steps=len(data),
            prefill_steps=int(pre.sum()),
            decode_only_steps=int(np.sum(~pre & (data.num_decode_reqs > 0))),
            prefill_tokens=(float(data.prefill_tokens[pre].min()), float(data.prefill_tokens[pre].max())),
            max_prefill_depth=(
                float(data.max_prefill_depth[pre].min()),
                float(data.max_prefill_depth[pre].max()),
            ),
            num_decode_reqs=(float(data.num_decode_reqs.min()), float(data.num_decode_reqs.max())),
            duration_s=(float(data.duration_s.min()), float(data.duration_s.max())),
        )

    def covers(self) -> Covers:
        return Covers(
            steps=int(self.steps),
            prefill_steps=int(self.prefill_steps),
            decode_only_steps=int(self.decode_only_steps),
            prefill_tokens=[int(v) for v in self.prefill_tokens],
            prefill_depth=[int(v) for v in self.max_prefill_depth],
            decode_batch=[int(v) for v in self.num_decode_reqs],
            duration_ms=[float(self.duration_s[0] * 1e3), float(self.duration_s[1] * 1e3)],
        )


@dataclass(frozen=True)
class StepTimeFit:
    coefficients: tuple[Coefficient, ...]
    r2: float
    residual_p50_s: float  # signed: actual - predicted
    residual_p99_s: float
    residual_max_s: float
    cv_rel_error: float  # cross-validated RMS of (actual - predicted) / predicted
    ranges: Ranges
    selection: tuple[TermChoice, ...] = field(default=())  # every term tried, in the order tried
    outliers: int = 0  # steps down-weighted by the robust fit (beyond HUBER_K robust deviations)
    residuals_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    predicted_s: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    @property
    def terms(self) -> tuple[str, ...]:
        return tuple(c.term for c in self.coefficients)

    def coefficient(self, term: str) -> float:
        for c in self.coefficients:
            if c.term == term:
                return c.value_s
        return 0.0

    def predict(self, data: StepData) -> np.ndarray:
        """Predicted duration (s) of each step of ``data`` (any shape: several chunks, decodes, KV)."""
        out = np.zeros(len(data))
        for c in self.coefficients:
            out = out + c.value_s * TERMS[c.term].column(data)
        return out

    def predict_single(
        self,
        tokens: np.ndarray | float,
        depth: np.ndarray | float,
        decode: np.ndarray | float,
        kv: np.ndarray | float = 0.0,
    ) -> np.ndarray:
        """Predicted duration (s) of steps with one prefill chunk of ``tokens`` starting at ``depth``
        next to ``decode`` decoding requests (``tokens`` = 0: a decode-only step)."""
        t, dep, b, k = np.broadcast_arrays(
            *(np.asarray(v, dtype=np.float64) for v in (tokens, depth, decode, kv))
        )
        out = np.zeros(t.shape)
        for c in self.coefficients:
            out = out + c.value_s * TERMS[c.term].single(t, dep, b, k)
        return out

    def summary(self) -> FitSummary:
        """The fit as the advice reports it: its formula, coefficients, quality and coverage."""
        return FitSummary(
            model=" + ".join("a" if c.term == "intercept" else f"{c.term}" for c in self.coefficients),
            coefficients=[c.row() for c in self.coefficients],
            r2=float(self.r2),
            residual_ms=Residuals(
                p50=float(self.residual_p50_s * 1e3),
                p99=float(self.residual_p99_s * 1e3),
                max=float(self.residual_max_s * 1e3),
            ),
            cv_rel_error=float(self.cv_rel_error),
            outliers_downweighted=int(self.outliers),
            steps_used=int(self.ranges.steps),
            covers=self.ranges.covers(),
            term_selection=list(self.selection),
        )


def check_data(data: StepData, *, min_steps: int = MIN_STEPS) -> StepData:
    """The usable rows, or FitError naming what is missing (too little data, a degenerate design)."""
    ok = np.isfinite(data.duration_s) & (data.duration_s > 0)
    data = data.select(ok)
    n = len(data)
    if n < min_steps:
        raise FitError(
            "too_little_data",
            f"{n} usable steps in the window; the fit needs at least {min_steps}",
            steps=n,
            needed=min_steps,
        )
    pre = data.is_prefill
    n_pre = int(pre.sum())
    if n_pre == 0:
        raise FitError(
            "no_prefill_steps", f"none of the {n} steps ran a prefill chunk: nothing to fit chunk cost on"
        )
    if n_pre < MIN_PREFILL_STEPS:
        raise FitError(
            "too_little_data",
            f"{n_pre} steps ran a prefill chunk; the fit needs at least {MIN_PREFILL_STEPS}",
            prefill_steps=n_pre,
            needed=MIN_PREFILL_STEPS,
        )
    sizes = np.unique(data.prefill_tokens[pre])
    if len(sizes) < MIN_PREFILL_SIZES:
        raise FitError(
            "degenerate",
            f"prefill steps have {len(sizes)} distinct sizes ({', '.join(str(int(s)) for s in sizes)} "
            f"tokens); the fit needs at least {MIN_PREFILL_SIZES}",
        )
    depths = np.unique(data.max_prefill_depth[pre])
    if len(depths) < MIN_DEPTHS or not np.any(data.prefill_depth_tokens[pre] > 0):
        raise FitError(
            "no_depth_variation",
            f"prefill steps cover {len(depths)} distinct chunk depths "
            f"({', '.join(str(int(s)) for s in depths[:5])}); the fit needs chunks at "
            f"{MIN_DEPTHS} or more depths (long prompts chunked, or prefix-cached prompts)",
        )
    if len(np.unique(data.num_decode_reqs)) < 2:
        raise FitError(
            "no_decode_variation",
            f"every step ran {int(data.num_decode_reqs[0])} decodes; the fit needs steps with different "
            f"decode batch sizes",
        )
    return data


def _design(data: StepData, terms: list[Term]) -> np.ndarray:
    return np.column_stack([t.column(data) for t in terms])


def _first_collinear(x: np.ndarray, terms: list[Term]) -> str:
    xs = x / column_scale(x)
    for k in range(1, xs.shape[1] + 1):
        if np.linalg.matrix_rank(xs[:, :k]) < k:
            return terms[k - 1].name
    return terms[-1].name


def fit_step_time(
    data: StepData,
    *,
    min_steps: int = MIN_STEPS,
    candidates: tuple[Term, ...] = CANDIDATE_TERMS,
    seed: int = 0,
) -> StepTimeFit:
    """Fit the base model plus the candidate terms that measurably help; FitError when it cannot.

    Least squares weighted by 1/ŷ² (relative error; see ``huber_weights``). A candidate is kept when it
    cuts the 5-fold cross-validated relative error by ``MIN_CV_GAIN`` (or the error in time by
    ``MIN_TIME_GAIN``); the best one first, repeatedly. Three steps: check the data and the base model,
    select the terms (on a sample), fit the chosen terms on every step.
    """
    data = check_data(data, min_steps=min_steps)
    base = list(BASE_TERMS)
    x = _design(data, base)
    _check_separable(x, base, data.duration_s)
    terms, selection, cv_rel_error = select_terms(data, x, candidates, seed=seed)
    return _fit_terms(data, terms, selection, cv_rel_error)


def _check_separable(x: np.ndarray, terms: list[Term], y: np.ndarray) -> None:
    """FitError when the steps cannot tell the base terms apart (a rank-deficient design)."""
    _, rank = weighted_solve(x, y, np.ones_like(y))
    if rank < len(terms):
        name = _first_collinear(x, terms)
        raise FitError(
            "degenerate", f"the steps cannot separate the cost of {name!r} from the other terms (collinear)"
        )


class _Tried(NamedTuple):
    """A model tried during term selection: its cross-validated errors, the term it adds, its design."""

    rel: float  # cross-validated relative error (inf: the term cannot be fitted)
    time: float  # cross-validated error in time
    name: str  # the term's ("base": the base model)
    x: np.ndarray  # design over the sample
    term: Term | None = None  # the candidate it adds


@dataclass(frozen=True)
class _Sample:
    """The steps term selection runs on: at most ``SELECTION_MAX_STEPS`` (a seeded sample; the choice
    does not need 10^5 steps and cross-validation refits many times), their weights and folds."""

    rows: np.ndarray  # indices into the data
    y: np.ndarray
    w: np.ndarray  # relative-error weights (Huber-weighted 1/ŷ² of the base model)
    folds: np.ndarray
    clip: float  # held-out squared errors are capped at clip² (stalls do not decide)

    @classmethod
    def draw(cls, x: np.ndarray, y: np.ndarray, seed: int) -> _Sample:
        w = huber_weights(x, y)
        rng = np.random.default_rng(seed)
        n = len(y)
        rows = rng.permutation(n)[:SELECTION_MAX_STEPS] if n > SELECTION_MAX_STEPS else np.arange(n)
        ys, ws, xs = y[rows], w[rows], x[rows]
        base_beta, _ = robust_solve(xs, ys, ws)
        clip = CV_CLIP * max(robust_scale((ys - xs @ base_beta) * np.sqrt(ws)), 1e-9)
        return cls(rows=rows, y=ys, w=ws, folds=rng.permutation(len(rows)) % CV_FOLDS, clip=clip)

    def errors(self, x: np.ndarray, name: str, term: Term | None = None) -> _Tried:
        """The cross-validated relative error and error in time (each step weighted by its duration,
        uncapped) of design ``x``."""
        rel = cv_error(x, self.y, self.w, self.folds, self.clip)
        return _Tried(rel, cv_error(x, self.y, self.w * self.y, self.folds, np.inf), name, x, term)

    def try_term(self, x: np.ndarray, term: Term, data: StepData) -> _Tried:
        """Design ``x`` with ``term`` added, and its errors (inf when the term adds no variation)."""
        xc = np.column_stack([x, term.column(data)[self.rows]])
        _, rank = weighted_solve(xc, self.y, self.w)
        if rank < xc.shape[1]:
            return _Tried(float("inf"), float("inf"), term.name, xc, term)
        return self.errors(xc, term.name, term)

    def choice(self, tried: _Tried, kept: bool) -> TermChoice:
        """``tried`` as the record of the selection, with the in-sample figures that justify it."""
        if not np.isfinite(tried.rel):
            return TermChoice(term=tried.name, kept=kept, why="no variation apart from the terms kept")
        figures = in_sample(tried.x, self.y, self.w)
        return TermChoice(
            term=tried.name,
            kept=kept,
            cv_rel_error=float(tried.rel),
            cv_time_error=float(tried.time),
            r2=float(figures["r2"]),
            residual_p99_ms=float(figures["residual_p99_ms"]),
        )


def _improves(tried: list[_Tried], best: _Tried) -> _Tried | None:
    """The candidate that cuts the relative error by ``MIN_CV_GAIN``, else the one that cuts the error in
    time by ``MIN_TIME_GAIN`` (both by ``MIN_CV_GAIN_ABS`` too), else None."""
    pick = min(tried, key=lambda t: t.rel)
    if pick.rel <= best.rel * (1 - MIN_CV_GAIN) and best.rel - pick.rel >= MIN_CV_GAIN_ABS:
        return pick
    pick = min(tried, key=lambda t: t.time)
    if pick.time <= best.time * (1 - MIN_TIME_GAIN) and best.time - pick.time >= MIN_CV_GAIN_ABS:
        return pick
    return None


def select_terms(
    data: StepData, x: np.ndarray, candidates: tuple[Term, ...], *, seed: int = 0
) -> tuple[list[Term], list[TermChoice], float]:
    """Forward selection from the base terms (design ``x``): the terms kept, every candidate's figures
    (the base first), and the kept model's cross-validated relative error."""
    sample = _Sample.draw(x, data.duration_s, seed)
    terms = list(BASE_TERMS)
    best = sample.errors(x[sample.rows], "base")
    selection = [sample.choice(best, kept=True)]
    remaining = list(candidates)
    while remaining and len(data) >= STEPS_PER_TERM * (len(terms) + 1):
        tried = [sample.try_term(best.x, cand, data) for cand in remaining]
        kept = _improves(tried, best)
        if kept is None:
            selection += [sample.choice(t, kept=False) for t in sorted(tried, key=lambda t: t.rel)]
            break
        assert kept.term is not None  # a candidate, not the base
        selection.append(sample.choice(kept, kept=True))
        best = kept
        terms.append(kept.term)
        remaining.remove(kept.term)
    return terms, selection, best.rel


def _fit_terms(
    data: StepData, terms: list[Term], selection: list[TermChoice], cv_rel_error: float
) -> StepTimeFit:
    """The chosen terms fitted on every step (re-weighted with the chosen model), with their standard
    errors, quality and the data's coverage."""
    y = data.duration_s
    x = _design(data, terms)
    w = huber_weights(x, y)
    beta, huber = robust_solve(x, y, w)
    w = w * huber
    pred = x @ beta
    resid = y - pred
    ss_res = float(resid @ resid)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    stderr = _stderr(x, w, resid)
    return StepTimeFit(
        coefficients=tuple(
            Coefficient(t.name, float(b), float(se)) for t, b, se in zip(terms, beta, stderr, strict=True)
        ),
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0,
        residual_p50_s=float(np.quantile(resid, 0.5)),
        residual_p99_s=float(np.quantile(resid, 0.99)),
        residual_max_s=float(resid.max()),
        cv_rel_error=cv_rel_error,
        ranges=Ranges.of(data),
        selection=tuple(selection),
        outliers=int(np.sum(huber < 1.0)),
        residuals_s=resid,
        predicted_s=pred,
    )


def _stderr(x: np.ndarray, w: np.ndarray, resid: np.ndarray) -> np.ndarray:
    """Standard error of each coefficient (weighted least squares, columns scaled for conditioning)."""
    n, k = x.shape
    sigma2 = float((w * resid**2).sum()) / max(n - k, 1)
    scale = column_scale(x)
    xs = (x / scale) * np.sqrt(w)[:, None]
    cov = np.linalg.pinv(xs.T @ xs) * sigma2
    return np.sqrt(np.clip(np.diag(cov), 0, None)) / scale
