"""Predicted remaining output length of a running request, from what this engine has finished.

Used by the escape valve's ``preempt_escape_for = "predicted"`` mode
(:mod:`engine_hooks.vllm.options`): a request preempted ``preempt_escape_after`` times is protected
from preemption until it has produced :meth:`OutputLengths.remaining` more output tokens.

The predictor, in full:

* history: the output lengths of the last ``window`` (1024) requests this engine finished by stop or
  length (aborted, cut off and failed requests are truncated, so they are left out);
* a request that has produced ``o`` tokens is predicted to end at the ``quantile`` (p90) of the
  history lengths *longer than* ``o`` (the length distribution conditioned on having come that
  far), so ``remaining = that length - o``; when no finished request was longer than ``o`` (it is
  already past everything seen: a likely runaway) the prediction is 0;
* with fewer than ``min_samples`` (8) lengths in the history there is nothing to predict from, and
  the remaining length is its ``max_tokens - o`` (protected until it finishes, as in ``"finish"``);
* always at most ``max_tokens - o``, and at least 1, so a protected request makes progress.

:class:`StepTimes` predicts an engine step's duration from what it schedules, for the admission
reserve's ``admission_step_target_s`` cap: an online least-squares fit, from the engine's own measured
steps, of

    seconds = a + b * tokens + c * attention work + e * chunk depth,   attention work = sum over the
    step's requests of n * (depth + n / 2) for a prefill chunk of n tokens at depth ``depth`` (n * depth
    for decodes), chunk depth = the deepest prefill chunk's start (0 without a prefill chunk),

with a, b, c, e >= 0 (the best non-negative fit over the subsets of the four terms), older steps
weighted down by ``decay`` per step (0.99), and no prediction before ``min_samples`` (8) steps were
seen. The chunk-depth term is what a chunk pays for reading its prefix's KV whatever its size: measured
on vLLM's CPU backend, a 27-token chunk at depth 10k took twice what the three-term fit predicted,
so without it the cap let small deep chunks overrun the target.

Depends on nothing but the standard library.
"""

from __future__ import annotations

import bisect
import math
from collections import deque


class OutputLengths:
    """A running window of finished output lengths and the conditional-quantile predictor above."""

    def __init__(self, window: int = 1024, quantile: float = 0.9, min_samples: int = 8):
        if window < 1 or not 0 < quantile <= 1 or min_samples < 1:
            raise ValueError("window >= 1, 0 < quantile <= 1 and min_samples >= 1 are required")
        self.quantile = quantile
        self.min_samples = min_samples
        self._order: deque[int] = deque(maxlen=window)  # arrival order, to drop the oldest
        self._sorted: list[int] = []  # the same lengths, sorted

    def __len__(self) -> int:
        return len(self._order)

    def add(self, length: int) -> None:
        """Record the output length of a request that finished by stop or length."""
        length = max(int(length), 0)
        order = self._order
        if len(order) == order.maxlen:
            old = order[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        order.append(length)
        bisect.insort(self._sorted, length)

    def remaining(self, produced: int, max_tokens: int | None) -> int:
        """Output tokens a request that has produced ``produced`` is predicted to still produce."""
        bound = max_tokens - produced if max_tokens is not None else None
        if len(self._sorted) < self.min_samples:
            predicted = bound if bound is not None else 1
        else:
            longer = self._sorted[bisect.bisect_right(self._sorted, produced) :]
            if longer:
                k = max(math.ceil(self.quantile * len(longer)) - 1, 0)
                predicted = longer[k] - produced
            else:
                predicted = 0
        if bound is not None:
            predicted = min(predicted, bound)
        return max(predicted, 1)


def attention_work(tokens: int, depth: int, prefill: bool = True) -> float:
    """Attention work of ``tokens`` new positions after ``depth`` computed ones (causal: each new
    position attends to everything before it)."""
    return tokens * (depth + tokens / 2.0) if prefill else float(tokens * depth)


_SCALE = (1.0, 1e-3, 1e-6, 1e-3)  # features in units of 1, 1k tokens, 1M work, 1k tokens of depth
_N = len(_SCALE)
_SUBSETS = tuple(
    tuple(i for i in range(_N) if mask >> i & 1)
    for mask in sorted(range(1, 1 << _N), key=lambda m: -bin(m).count("1"))
)


class StepTimes:
    """Online least-squares model of step duration (see the module docstring)."""

    def __init__(self, decay: float = 0.99, min_samples: int = 8):
        if not 0 < decay <= 1 or min_samples < 1:
            raise ValueError("0 < decay <= 1 and min_samples >= 1 are required")
        self.decay = decay
        self.min_samples = min_samples
        self.samples = 0
        self._xx = [[0.0] * _N for _ in range(_N)]  # weighted sums of x x^T
        self._xy = [0.0] * _N  # ... of x y
        self._yy = 0.0  # ... of y^2
        self._coef: tuple[float, float, float, float] | None = None
        self._dirty = False

    def add(self, tokens: int, work: float, seconds: float, depth: int = 0) -> None:
        """Record one step: tokens scheduled, their attention work, its measured duration, and the
        deepest prefill chunk's start (0 without a prefill chunk)."""
        if tokens <= 0 or not seconds >= 0:
            return
        x = (1.0, tokens * _SCALE[1], work * _SCALE[2], depth * _SCALE[3])
        g = self.decay
        xx, xy = self._xx, self._xy
        for i in range(_N):
            row = xx[i]
            for j in range(_N):
                row[j] = g * row[j] + x[i] * x[j]
            xy[i] = g * xy[i] + x[i] * seconds
        self._yy = g * self._yy + seconds * seconds
        self.samples += 1
        self._dirty = True

    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(a s, b s/token, c s/work, e s/token of chunk depth), None before ``min_samples`` steps or
        without a solvable fit."""
        if self.samples < self.min_samples:
            return None
        if self._dirty:
            self._dirty = False
            self._coef = self._solve()
        return self._coef

    def predict(self, tokens: int, work: float, depth: int = 0) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c, e = coef
        return a + b * tokens + c * work + e * depth

    def max_chunk(self, target_s: float, tokens: int, work: float, depth: int) -> int | None:
        """The largest prefill chunk at ``depth`` that, added to a step already holding ``tokens``
        tokens of ``work``, keeps its predicted duration within ``target_s`` (0 when even the rest of
        the step is predicted over it); None without a fit or when the fit puts no bound on it."""
        coef = self.coefficients()
        if coef is None:
            return None
        a, b, c, e = coef
        # a + b (tokens + n) + c (work + n depth + n^2 / 2) + e depth <= target, solved for n
        qa = c / 2.0
        qb = b + c * depth
        qc = a + b * tokens + c * work + e * depth - target_s
        if qc >= 0:
            return 0
        if qa <= 0:
            return None if qb <= 0 else int(-qc / qb)
        return int((-qb + math.sqrt(qb * qb - 4.0 * qa * qc)) / (2.0 * qa))

    def _solve(self) -> tuple[float, float, float, float] | None:
        best: tuple[float, list[float]] | None = None
        xx, xy = self._xx, self._xy
        ridge = 1e-9 * sum(xx[i][i] for i in range(_N))
        for subset in _SUBSETS:  # largest first: a smaller subset must fit strictly better
            m = [[xx[i][j] + (ridge if i == j else 0.0) for j in subset] for i in subset]
            v = [xy[i] for i in subset]
            beta = _solve_linear(m, v)
            if beta is None or any(b < 0 for b in beta):
                continue
            full = [0.0] * _N
            for i, b in zip(subset, beta, strict=True):
                full[i] = b
            sse = self._yy - 2 * sum(full[i] * xy[i] for i in range(_N))
            sse += sum(full[i] * xx[i][j] * full[j] for i in range(_N) for j in range(_N))
            if best is None or sse < best[0] - 1e-15:
                best = (sse, full)
        if best is None:
            return None
        a, b, c, e = best[1]
        return a * _SCALE[0], b * _SCALE[1], c * _SCALE[2], e * _SCALE[3]


def _solve_linear(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a (near) singular system."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    scale = max((abs(x) for row in m for x in row), default=0.0)
    if scale <= 0:
        return None
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) <= 1e-12 * scale:
            return None
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    out = [0.0] * n
    for r in range(n - 1, -1, -1):
        out[r] = (a[r][n] - sum(a[r][k] * out[k] for k in range(r + 1, n))) / a[r][r]
    return out


__all__ = ["OutputLengths", "StepTimes", "attention_work"]
