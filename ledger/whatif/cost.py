"""A fitted step-time model as the replay's step cost: seconds for a :class:`StepShape`.

The replay asks for one duration per step (hundreds of thousands per hour of a fleet), so the fit's
terms are evaluated here on one shape with plain arithmetic rather than through numpy arrays. The
terms are those of :mod:`ledger.advice.terms`; a test checks that :func:`fitted_cost` gives what
:meth:`ledger.advice.fit.StepTimeFit.predict` gives on the same steps, so the two cannot drift.
A step never lasts less than ``floor_s`` (a fit can go below zero far outside its data).
"""

from __future__ import annotations

from collections.abc import Callable

from ledger.advice.fit import StepTimeFit
from ledger.whatif.types import StepCost, StepShape

_SCALAR: dict[str, Callable[[StepShape], float]] = {
    "intercept": lambda s: 1.0,
    "prefill_tokens": lambda s: float(s.prefill_tokens),
    "prefill_depth_tokens": lambda s: float(s.prefill_depth_tokens),
    "num_decode_reqs": lambda s: float(s.num_decode_reqs),
    "num_prefill_reqs": lambda s: float(s.num_prefill_reqs),
    "max_prefill_depth": lambda s: float(s.max_prefill_depth),
    "prefill_tokens_sq": lambda s: float(s.prefill_tokens) ** 2 / max(s.num_prefill_reqs, 1),
    "kv_usage": lambda s: float(s.kv_usage),
}


def fitted_cost(fit: StepTimeFit, *, floor_s: float = 1e-4) -> StepCost:
    """The step cost of ``fit``: Σ coefficient x term(shape), at least ``floor_s``."""
    terms = [(c.value_s, _SCALAR[c.term]) for c in fit.coefficients]

    def cost(shape: StepShape) -> float:
        total = 0.0
        for value, term in terms:
            total += value * term(shape)
        return total if total > floor_s else floor_s

    return cost
