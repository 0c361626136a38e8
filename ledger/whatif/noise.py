"""Step-time noise for the replay: the measured spread of decode steps around their fitted time, and
the engine loop's time between steps.

A fit predicts a step's mean time; a decode ITL p99 is made of the decode steps that ran long: a
descheduled thread, a garbage collection, a cache-cold kernel. On this CPU a decode-only step's p99
is about twice its fitted time, so a replay of mean times predicted ITL p99 at under half of what was
measured. The replay therefore multiplies a decode-only step's fitted time by a factor drawn from the
recorded window's own decode-only steps' ratios ``actual / fitted`` (:func:`decode_samples`). Steps that run a
prefill chunk keep their fitted time: drawn from the window's prefill steps (short prompts' prefills,
mostly), factors made a profile-fitted replay's long prompts 30-50 % slow (``bench.whatif_vllm``);
their time is what the fit is for.

A step's fitted time is its ``duration_s``: ``schedule()`` to the end of ``update_from_output()``. A
decoding request waits longer between tokens: the ledger's ITL is the step's ``interval_s``, from the
end of the previous step to the end of this one, which also holds the engine loop's own work between
steps (output processing, adding the requests that came). On this CPU its median is under 0.1 ms, but
not its tail: a real-vLLM window's ITL p99 was 8.3 ms over durations and 11.5 ms over intervals, and a
replay without the loop predicted that window's own ITL p99 27 % low (+2 % with it). So a step that
follows another directly also lasts the loop time the window measured before a step of its class
(``interval_s - duration_s``, decode-only steps' paired with their ratio, so that a step drawn is one
step the window ran; steps with a chunk drawn from theirs).

A small window's tails rest on a few slow steps, so one draw is itself noise; the service replays it
several times with the draws made anew (:meth:`StepNoise.reseeded`, :func:`draws_for`) and pools them.

The draw for step ``k`` is a hash of ``k`` and a seed, not a random stream, so a replay is
deterministic and the fast-forward (:mod:`ledger.whatif.fastforward`), which times many steps in one
go, draws the same factors as the plain loop.
"""

from __future__ import annotations

import copy

import numpy as np

from ledger.advice.fit import StepTimeFit
from ledger.advice.terms import StepData

RATIO_RANGE = (0.2, 10.0)  # a ratio outside this is a measurement artefact, not step noise
MIN_STEPS = 20  # fewer steps with a usable ratio: no noise (factor 1)
# Replays of a window with noise drawn anew, pooled, until this many requests were replayed (at most
# MAX_DRAWS): one draw of a 160-request window gave its own ITL p99 anywhere from 6.8 to 12.6 ms.
DRAW_REQUESTS = 5_000
MAX_DRAWS = 32

_MULT = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


class StepNoise:
    """How replayed step ``k`` (an index from 0) differs from its fitted time, chosen by a hash of
    ``k`` and ``seed``: ``noise.decode(k)`` is a decode-only step's factor (one of ``ratios``) and
    the loop time before the step (``decode_gaps``, paired with ``ratios``: the same recorded
    step's), ``noise.prefill_gap(k)`` the loop time before a step with
    a chunk (one of ``prefill_gaps``), to which the replay adds ``per_first_token`` seconds per first
    token the step before emitted. Without gaps, the loop takes no time."""

    def __init__(
        self,
        ratios: np.ndarray | list[float],
        seed: int = 0,
        *,
        decode_gaps: np.ndarray | list[float] | None = None,
        prefill_gaps: np.ndarray | list[float] | None = None,
        per_first_token: float = 0.0,
    ) -> None:
        self.ratios = _checked(ratios, "ratios", positive=True)
        n = len(self.ratios)
        self.decode_gaps = [0.0] * n if decode_gaps is None else _checked(decode_gaps, "decode_gaps")
        if len(self.decode_gaps) != n:
            raise ValueError(f"decode_gaps pairs with ratios: {len(self.decode_gaps)} values for {n} ratios")
        self.prefill_gaps = (
            [0.0] if prefill_gaps is None or not len(prefill_gaps) else _checked(prefill_gaps, "prefill_gaps")
        )
        if not (per_first_token >= 0.0 and np.isfinite(per_first_token)):
            raise ValueError(f"step noise needs a finite per_first_token >= 0 (got {per_first_token})")
        self.per_first_token = float(per_first_token)
        self.seed = int(seed) & _MASK

    def reseeded(self, seed: int) -> StepNoise:
        """The same samples, drawn by another seed: another replay of the same window."""
        other = copy.copy(self)
        other.seed = int(seed) & _MASK
        return other

    def _pick(self, k: int, n: int) -> int:
        h = ((k + 1) * _MULT ^ self.seed) & _MASK
        h = ((h ^ (h >> 31)) * _MULT) & _MASK  # splitmix-like: neighbouring steps draw unrelated factors
        return (h >> 11) % n

    def decode(self, k: int) -> tuple[float, float]:
        """Decode-only step ``k``'s factor and the loop time before it (one recorded step's pair)."""
        i = self._pick(k, len(self.ratios))
        return self.ratios[i], self.decode_gaps[i]

    def prefill_gap(self, k: int) -> float:
        return self.prefill_gaps[self._pick(k, len(self.prefill_gaps))]

    def loop(self, gap: float, first_tokens: int) -> float:
        """The engine loop before a step that follows another: the drawn ``gap`` plus the cost of the
        ``first_tokens`` the step before emitted (one expression for the replay and its fast-forward,
        which must agree to the bit)."""
        return gap + self.per_first_token * first_tokens


def _checked(values_in: np.ndarray | list[float], name: str, *, positive: bool = False) -> list[float]:
    values = np.asarray(values_in, dtype=np.float64)
    bad = values <= 0 if positive else values < 0
    if not len(values) or not np.all(np.isfinite(values)) or np.any(bad):
        raise ValueError(f"step noise needs one or more finite {name} {'> 0' if positive else '>= 0'}")
    return values.tolist()


def loop_gaps(data: StepData) -> np.ndarray:
    """The engine loop's time before each step of ``data``: ``interval_s - duration_s``, 0 where the
    interval is unknown (a source's first step) or shorter than the step (clock skew), and where the
    loop was idle before the step (no request was decoding: the interval holds the wait for work)."""
    with np.errstate(invalid="ignore"):
        gap = data.interval_s - data.duration_s
    busy = data.num_decode_reqs > 0
    return np.where(np.isfinite(gap) & (gap > 0) & busy, gap, 0.0)


def decode_samples(fit: StepTimeFit, data: StepData, gaps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``duration / fitted`` of the decode-only steps of ``data`` within ``RATIO_RANGE``, and the
    loop time before each (``gaps``: one per step of ``data``)."""
    decode_only = (data.prefill_tokens == 0) & (data.num_decode_reqs > 0)
    steps = data.select(decode_only)
    if not len(steps):
        return np.zeros(0), np.zeros(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = steps.duration_s / fit.predict(steps)
    lo, hi = RATIO_RANGE
    keep = np.isfinite(r) & (r >= lo) & (r <= hi)
    return r[keep], gaps[decode_only][keep]


def first_token_cost(data: StepData, prev_prefills: np.ndarray, gaps: np.ndarray) -> float:
    """Seconds of engine loop per first token the previous step emitted: the least-squares slope of
    the loop time before a busy step (``gaps``: :func:`loop_gaps` of ``data``) on its predecessor's
    prefill requests, at
    least 0 (0 when they never vary). After a step that completed 32-44 prompts at once, the loop took
    3.2-5.4 ms on this CPU against 0.1-0.2 ms after a step with none: output processing per new
    request."""
    known = (data.num_decode_reqs > 0) & np.isfinite(data.interval_s)
    f, g = prev_prefills[known], gaps[known]
    if len(f) < 2 or np.ptp(f) == 0:
        return 0.0
    slope = float(np.cov(f, g, bias=True)[0, 1] / np.var(f))
    return max(slope, 0.0)


def draws_for(requests: int) -> int:
    """How many noisy replays of a window of ``requests`` requests to pool (:data:`DRAW_REQUESTS`)."""
    return max(1, min(MAX_DRAWS, -(-DRAW_REQUESTS // max(requests, 1))))


def window_noise(
    fit: StepTimeFit, data: StepData, seed: int = 0, prev_prefills: np.ndarray | None = None
) -> StepNoise | None:
    """The noise of a window's steps against ``fit``: its decode-only steps' ratios with the loop time
    before each, and the loop time before its steps with a chunk (those that follow a decoding step);
    None when fewer than ``MIN_STEPS`` decode-only steps tell it. With ``prev_prefills`` (each step's
    predecessor's prefill requests), the loop's cost per first token (:func:`first_token_cost`) is
    taken out of the drawn loop times and charged, in the replay, per first token of the step before."""
    gaps = loop_gaps(data)
    per_first = 0.0
    if prev_prefills is not None:
        per_first = first_token_cost(data, prev_prefills, gaps)
        gaps = np.maximum(gaps - per_first * prev_prefills, 0.0)
    r, decode_gaps = decode_samples(fit, data, gaps)
    if len(r) < MIN_STEPS:
        return None
    chunk = (data.prefill_tokens > 0) & (data.num_decode_reqs > 0)
    return StepNoise(
        r, seed=seed, decode_gaps=decode_gaps, prefill_gaps=gaps[chunk], per_first_token=per_first
    )


__all__ = ["StepNoise", "decode_samples", "draws_for", "first_token_cost", "loop_gaps", "window_noise"]
