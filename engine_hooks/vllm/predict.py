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


__all__ = ["OutputLengths"]
