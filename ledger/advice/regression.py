"""The fit's numerics: robust (Huber) weighted least squares, column scaling, and k-fold
cross-validated error with clipped residuals. numpy only; the step-time model is ``ledger.advice.fit``."""

from __future__ import annotations

import numpy as np

CV_FOLDS = 5
HUBER_K = 2.0  # robust fit: steps beyond this many robust deviations are down-weighted
ROBUST_ITERATIONS = 3
CV_CLIP = 4.0  # cross-validation caps a held-out step's error at this many robust deviations


def weighted_solve(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, int]:
    """Weighted least squares on column-scaled x; (coefficients in x's units, rank).

    Normal equations on the scaled columns (p <= 8, so X'WX is tiny and fast to build even for 10^5
    steps); SVD least squares when they are singular or ill-conditioned."""
    scale = column_scale(x)
    xs = x / scale
    xw = xs * w[:, None]
    gram = xs.T @ xw
    p = gram.shape[0]
    if np.linalg.cond(gram) < 1e12:
        return np.linalg.solve(gram, xw.T @ y) / scale, p
    sw = np.sqrt(w)
    beta, _, rank, _ = np.linalg.lstsq(xs * sw[:, None], y * sw, rcond=None)
    return beta / scale, int(rank)


def column_scale(x: np.ndarray) -> np.ndarray:
    scale = np.max(np.abs(x), axis=0)
    scale[scale == 0] = 1.0
    return scale


def robust_solve(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares made robust with Huber weights (iteratively re-weighted): steps whose
    weighted residual lies beyond ``HUBER_K`` robust standard deviations (1.4826·MAD) count less,
    so a few stalls (a preempted CPU, a GC pause) do not bend the coefficients. Returns the
    coefficients and the Huber weights (1 for ordinary steps)."""
    beta, _ = weighted_solve(x, y, w)
    h = np.ones_like(y)
    sw = np.sqrt(w)
    for _ in range(ROBUST_ITERATIONS):
        e = (y - x @ beta) * sw
        s = robust_scale(e)
        if s <= 0:
            break
        h = np.minimum(1.0, HUBER_K * s / np.maximum(np.abs(e), 1e-300))
        beta, _ = weighted_solve(x, y, w * h)
    return beta, h


def robust_scale(e: np.ndarray) -> float:
    return float(1.4826 * np.median(np.abs(e - np.median(e))))


def huber_weights(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Weights 1/ŷ² from an unweighted first pass: step-time noise is multiplicative (a 3% jitter on
    an 800 ms step outweighs a whole 10 ms step), and the advice lives among the short steps."""
    beta, _ = robust_solve(x, y, np.ones_like(y))
    floor = max(float(np.quantile(y, 0.01)), 1e-6)
    return 1.0 / np.maximum(x @ beta, floor) ** 2


def in_sample(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, float]:
    """R² and signed residual p99 (ms) of the full-data fit: the figures that justify a term."""
    beta, _ = robust_solve(x, y, w)
    resid = y - x @ beta
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(resid @ resid) / ss_tot if ss_tot > 0 else 0.0
    return {"r2": r2, "residual_p99_ms": float(np.quantile(resid, 0.99)) * 1e3}


def cv_error(x: np.ndarray, y: np.ndarray, w: np.ndarray, folds: np.ndarray, clip: float) -> float:
    """Cross-validated RMS of the weighted residual (with w = 1/ŷ², the relative error of a step),
    each squared error capped at ``clip``² so that the held-out stalls, which no term can predict,
    do not decide which terms are kept."""
    sq = 0.0
    sw = np.sqrt(w)
    for k in range(CV_FOLDS):
        test = folds == k
        beta, _ = robust_solve(x[~test], y[~test], w[~test])
        e = (y[test] - x[test] @ beta) * sw[test]
        sq += float(np.sum(np.minimum(e * e, clip * clip)))
    return float(np.sqrt(sq / len(y)))
