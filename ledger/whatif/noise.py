"""Step-time noise for the replay: the measured spread of real steps around the fitted step time.

A fit predicts a step's mean time; a tail (a decode ITL p99, a short request's TTFT p99) is made of
the steps that ran long: a descheduled thread, a garbage collection, a cache-cold kernel. On this
CPU a decode step's p99 is about twice its fitted time, so a replay of mean times predicted ITL p99
at half of what was measured. The replay therefore multiplies step ``k``'s fitted time by a factor
drawn from the recorded window's own ratios ``actual / fitted`` of steps of its class (decode-only, or
with a prefill chunk; :func:`ratios`): the window's spread, and, when the fit comes from elsewhere (a
profile), the window's level against it.

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
    """``noise(k, prefill)``: the factor of step ``k`` (an index from 0), one of the ratios of its
    class (steps that ran a prefill chunk, or decode-only steps), chosen by a hash of ``k`` and
    ``seed``. The classes differ: a decode-only step's tail is its own (a 2 ms step doubled by a
    hiccup), a long chunk's time varies far less."""

    def __init__(
        self, decode: np.ndarray | list[float], prefill: np.ndarray | list[float] | None = None, seed: int = 0
    ) -> None:
        self.decode = _checked(decode)
        self.prefill = _checked(prefill) if prefill is not None and len(prefill) else self.decode
        self._seed = int(seed) & _MASK

    def __call__(self, k: int, prefill: bool = False) -> float:
        h = ((k + 1) * _MULT ^ self._seed) & _MASK
        h = ((h ^ (h >> 31)) * _MULT) & _MASK  # splitmix-like: neighbouring steps draw unrelated factors
        values = self.prefill if prefill else self.decode
        return values[(h >> 11) % len(values)]


def _checked(ratios: np.ndarray | list[float]) -> list[float]:
    values = np.asarray(ratios, dtype=np.float64)
    if not len(values) or not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError("step noise needs one or more finite ratios > 0")
    return values.tolist()


def ratios(fit: StepTimeFit, data: StepData) -> tuple[np.ndarray, np.ndarray]:
    """``duration / fitted`` of the steps of ``data`` within ``RATIO_RANGE``: (decode-only steps, steps
    that ran a prefill chunk)."""
    ran = (data.prefill_tokens > 0) | (data.num_decode_reqs > 0)
    if not np.any(ran):
        return np.zeros(0), np.zeros(0)
    steps = data.select(ran)
    predicted = fit.predict(steps)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = steps.duration_s / predicted
    lo, hi = RATIO_RANGE
    ok = np.isfinite(r) & (r >= lo) & (r <= hi)
    pre = steps.prefill_tokens > 0
    return r[ok & ~pre], r[ok & pre]


def window_noise(fit: StepTimeFit, data: StepData, seed: int = 0) -> StepNoise | None:
    """The noise of a window's steps against ``fit``, per class (a class with fewer than ``MIN_STEPS``
    steps takes the other's); None when the window has too few steps in all."""
    decode, prefill = ratios(fit, data)
    if len(decode) + len(prefill) < MIN_STEPS:
        return None
    if len(decode) < MIN_STEPS:
        decode = np.concatenate((decode, prefill))
    if len(prefill) < MIN_STEPS:
        prefill = np.concatenate((decode, prefill)) if len(prefill) else decode
    return StepNoise(decode, prefill, seed)


__all__ = ["StepNoise", "ratios", "window_noise"]
