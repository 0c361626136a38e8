"""What a replay gives back (:class:`Replay`), its summary (:class:`ReplaySummary`, the measured
window's too) and the weighted quantile the summary uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ledger.records import UNSET, UnsetType
from ledger.whatif.answer import ReplayTails


def weighted_quantile(values: Any, weights: Any, q: float) -> float | None:
    """The lower nearest-rank ``q``-quantile of weighted samples, None when there are none.

    The smallest value whose cumulative weight (values in increasing order) reaches ``q`` x the
    total weight: numpy's ``"inverted_cdf"`` method, generalised to weights. With unit weights the
    p99 of 100 samples is the 99th smallest; a sample of weight w counts as w equal samples. A
    relative 1e-12 is taken off ``q`` x total so that a product like 0.99 x 100 that rounds up past
    an integer does not move the answer one rank up.
    """
    v = np.asarray(values, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if v.shape != w.shape:
        raise ValueError(f"values and weights differ in shape: {v.shape} vs {w.shape}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1] (got {q})")
    keep = w > 0
    if not keep.all():
        v, w = v[keep], w[keep]
    if not v.size:
        return None
    order = np.argsort(v, kind="stable")
    cum = np.cumsum(w[order])
    target = q * cum[-1] * (1.0 - 1e-12)
    at = min(int(np.searchsorted(cum, target, side="left")), v.size - 1)
    return float(v[order[at]])


def quantile(values: Any, q: float) -> float | None:
    """:func:`weighted_quantile` with unit weights."""
    v = np.asarray(values, dtype=np.float64)
    return weighted_quantile(v, np.ones_like(v), q)


class ReplaySummary(ReplayTails):
    """A replay's tails (:class:`ReplayTails`, what the answer shows of them) and what the answer leaves
    out: each long prompt's TTFT (``long_ttft_s``, in request order: with a long-prompt cut only) and,
    for a replay (not a measured window), its ``steps`` and ``simulated_s``.

    Read by key too (``summary["itl_p99_s"]``, ``"long_ttft_s" in summary``), as its JSON has it: an
    unset field is not there."""

    long_ttft_s: list[float] | UnsetType = UNSET
    steps: int | UnsetType = UNSET
    simulated_s: float | UnsetType = UNSET

    def __getitem__(self, key: str) -> Any:
        value = getattr(self, key) if key in self.__struct_fields__ else UNSET
        if value is UNSET:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.__struct_fields__ and getattr(self, key) is not UNSET


def summarise(
    ttft_s: np.ndarray,
    prompt_tokens: np.ndarray,
    e2e_s: np.ndarray,
    long_prompt_tokens: int | None,
    *,
    itl_p99_s: float | None,
    preemptions: int,
    requests: int,
    draws: int = 1,
    steps: int | UnsetType = UNSET,
    simulated_s: float | UnsetType = UNSET,
) -> ReplaySummary:
    """The tails a replay and a measured window are compared on: TTFT p50/p99, end-to-end p99 and, with
    ``long_prompt_tokens``, the TTFT of each request whose prompt has at least that many tokens
    (``long_ttft_s``, in request order, and their max) and the TTFT p99 of the others
    (``short_ttft_p99_s``; both null without it); the ITL p99, preemptions and counts as given.

    ``draws``: the arrays hold that many replays of the same requests one after the other (step noise
    drawn anew in each); the quantiles are those of all of them pooled, and a long request's TTFT is
    its median over the draws."""
    long_ttft: list[float] | UnsetType = UNSET
    long_max = short_p99 = None
    if long_prompt_tokens is not None:
        is_long = prompt_tokens >= long_prompt_tokens
        n = len(ttft_s) // draws
        longs = np.median(ttft_s.reshape(draws, n)[:, is_long[:n]], axis=0) if n else ttft_s[:0]
        long_ttft = [float(x) for x in longs]
        long_max = float(longs.max()) if longs.size else None
        short_p99 = quantile(ttft_s[~is_long], 0.99)
    return ReplaySummary(
        ttft_p50_s=quantile(ttft_s, 0.5),
        ttft_p99_s=quantile(ttft_s, 0.99),
        itl_p99_s=itl_p99_s,
        e2e_p99_s=quantile(e2e_s, 0.99),
        short_ttft_p99_s=short_p99,
        long_ttft_max_s=long_max,
        preemptions=preemptions,
        requests=requests,
        long_ttft_s=long_ttft,
        steps=steps,
        simulated_s=simulated_s,
    )


@dataclass(frozen=True, eq=False)
class Replay:
    """Per-request outcomes (in the order of the requests given to the replay) and the step totals.

    ``itl_gap_s`` / ``itl_count``: the decode inter-token gaps of all requests as weighted samples, a
    gap of ``itl_gap_s[k]`` seconds that ``itl_count[k]`` tokens had (one sample per step for the
    requests that decoded in consecutive steps, one per token for any other gap: after a skipped
    step, or the token that ends a resumed request's recomputation). The gap before the first token
    (the TTFT) is not among them. ``simulated_s`` runs from the first arrival to the end of the
    last step.

    ``draws`` > 1: the same requests replayed that many times with step noise drawn anew
    (:func:`ledger.whatif.service.pooled_replay`), the per-request arrays one draw after the other;
    ``steps`` and ``simulated_s`` are the draws' total and longest.
    """

    request_id: list[str]
    prompt_tokens: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    preemptions: np.ndarray
    itl_gap_s: np.ndarray
    itl_count: np.ndarray
    steps: int
    simulated_s: float
    draws: int = 1

    def summary(self, long_prompt_tokens: int | None = None) -> ReplaySummary:
        """Tail latencies: TTFT p50/p99, decode ITL p99 (weighted), end-to-end p99, preemptions.

        With ``long_prompt_tokens``, also the TTFT of each request whose prompt has at least that
        many tokens (``long_ttft_s``, in request order, and their max) and the TTFT p99 of the others
        (``short_ttft_p99_s``). Quantiles are lower nearest-rank (:func:`weighted_quantile`); None
        where there is nothing to take one of. Over several draws: quantiles of the draws pooled, a long
        request's median TTFT, and ``requests``, ``steps`` and ``preemptions`` per draw (preemptions
        their mean, rounded).
        """
        k = self.draws
        return summarise(
            self.ttft_s,
            self.prompt_tokens,
            self.e2e_s,
            long_prompt_tokens,
            itl_p99_s=weighted_quantile(self.itl_gap_s, self.itl_count, 0.99),
            preemptions=round(int(self.preemptions.sum()) / k),
            requests=len(self.request_id) // k,
            draws=k,
            steps=self.steps // k,
            simulated_s=self.simulated_s,
        )


__all__ = ["Replay", "ReplaySummary", "quantile", "summarise", "weighted_quantile"]
