"""Step-time noise for the replay: the measured spread of decode steps around their fitted time.

A fit predicts a step's mean time; a decode ITL p99 is made of the decode steps that ran long: a
descheduled thread, a garbage collection, a cache-cold kernel. On this CPU a decode-only step's p99
is about twice its fitted time, so a replay of mean times predicted ITL p99 at under half of what was
measured. The replay therefore multiplies a decode-only step's fitted time by a factor drawn from the
recorded window's own decode-only steps' ratios ``actual / fitted`` (:func:`ratios`). Steps that run a
prefill chunk keep their fitted time: drawn from the window's prefill steps (short prompts' prefills,
mostly), factors made a profile-fitted replay's long prompts 30-50 % slow (``bench.whatif_vllm``);
their time is what the fit is for.

The draw for step ``k`` is a hash of ``k`` and a seed, not a random stream, so a replay is
deterministic and the fast-forward (:mod:`ledger.whatif.fastforward`), which times many steps in one
go, draws the same factors as the plain loop.
"""

from __future__ import annotations

import numpy as np

from ledger.advice.fit import StepTimeFit
from ledger.advice.terms import StepData

RATIO_RANGE = (0.2, 10.0)  # a ratio outside this is a measurement artefact, not step noise
MIN_STEPS = 20  # fewer steps with a usable ratio: no noise (factor 1)

_MULT = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


class StepNoise:
    """``noise(k)``: the factor of decode-only step ``k`` (an index from 0), one of ``ratios`` chosen by
    a hash of ``k`` and ``seed``."""

    def __init__(self, ratios: np.ndarray | list[float], seed: int = 0) -> None:
        self.ratios = _checked(ratios)
        self._seed = int(seed) & _MASK

    def __call__(self, k: int) -> float:
        h = ((k + 1) * _MULT ^ self._seed) & _MASK
        h = ((h ^ (h >> 31)) * _MULT) & _MASK  # splitmix-like: neighbouring steps draw unrelated factors
        return self.ratios[(h >> 11) % len(self.ratios)]


def _checked(ratios: np.ndarray | list[float]) -> list[float]:
    values = np.asarray(ratios, dtype=np.float64)
    if not len(values) or not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError("step noise needs one or more finite ratios > 0")
    return values.tolist()


def ratios(fit: StepTimeFit, data: StepData) -> np.ndarray:
    """``duration / fitted`` of the decode-only steps of ``data``, within ``RATIO_RANGE``."""
    decode_only = (data.prefill_tokens == 0) & (data.num_decode_reqs > 0)
    if not np.any(decode_only):
        return np.zeros(0)
    steps = data.select(decode_only)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = steps.duration_s / fit.predict(steps)
    lo, hi = RATIO_RANGE
    return r[np.isfinite(r) & (r >= lo) & (r <= hi)]


def window_noise(fit: StepTimeFit, data: StepData, seed: int = 0) -> StepNoise | None:
    """The noise of a window's decode-only steps against ``fit``; None when fewer than ``MIN_STEPS``
    tell it."""
    r = ratios(fit, data)
    return StepNoise(r, seed=seed) if len(r) >= MIN_STEPS else None


__all__ = ["StepNoise", "ratios", "window_noise"]
