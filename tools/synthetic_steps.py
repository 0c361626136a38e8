"""Synthetic ``step`` events from a known step-cost model, for tests, benchmarks and demos.

Two ground truths:

* ``MEASURED_CPU``: the figures measured on vLLM (random Llama, hidden 512, 4 layers, CPU; issue 5):
  a chunk of 256 / 512 / 2048 tokens costs 8.4 / 28 / 144 ms at depth 0 plus 6.6 / 11.1 / 41 ms per
  1k tokens of depth; a decode-only step costs 1.65 / 4.75 / 13.9 ms at batch 1 / 32 / 128. Between
  the measured points the cost is interpolated linearly (chunk sizes and batches outside them are
  extrapolated from the nearest two), and a prefill step pays its decodes' marginal cost on top.
* ``LinearCost``: a + b·tokens + c·tokens·depth + d·decodes, e.g. the seed's worked example.

Steps look like chunked prefill of long prompts: a prompt chunked by T tokens runs chunks at depths
0, T, 2T, ... so every depth is a multiple of the chunk size. Noise is multiplicative (log-normal)
plus rare stalls, as on a shared machine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine_hooks import events as ev


class CostModel:
    """Ground-truth step cost in seconds."""

    def cost_s(self, tokens: float, depth: float, decodes: float) -> float:
        raise NotImplementedError


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear through (xs, ys), extrapolated from the nearest two points outside them."""
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = int(np.searchsorted(xs, x)) - 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class MeasuredCost(CostModel):
    chunk_tokens: tuple[float, ...] = (256, 512, 2048)
    chunk_ms_at_depth0: tuple[float, ...] = (8.4, 28.0, 144.0)
    chunk_ms_per_1k_depth: tuple[float, ...] = (6.6, 11.1, 41.0)
    decode_batch: tuple[float, ...] = (1, 32, 128)
    decode_ms: tuple[float, ...] = (1.65, 4.75, 13.9)

    def decode_step_ms(self, decodes: float) -> float:
        return _interp(decodes, self.decode_batch, self.decode_ms)

    def chunk_ms(self, tokens: float, depth: float) -> float:
        base = _interp(tokens, self.chunk_tokens, self.chunk_ms_at_depth0)
        slope = _interp(tokens, self.chunk_tokens, self.chunk_ms_per_1k_depth)
        return base + slope * depth / 1000.0

    def cost_s(self, tokens: float, depth: float, decodes: float) -> float:
        if tokens <= 0:
            return self.decode_step_ms(decodes) / 1e3
        extra = self.decode_step_ms(decodes) - self.decode_step_ms(0) if decodes > 0 else 0.0
        return (self.chunk_ms(tokens, depth) + extra) / 1e3


@dataclass(frozen=True)
class LinearCost(CostModel):
    a_ms: float
    b_ms_per_token: float
    c_ms_per_token_depth: float
    d_ms_per_decode: float

    def cost_s(self, tokens: float, depth: float, decodes: float) -> float:
        return (
            self.a_ms
            + self.b_ms_per_token * tokens
            + self.c_ms_per_token_depth * tokens * depth
            + self.d_ms_per_decode * decodes
        ) / 1e3


MEASURED_CPU = MeasuredCost()
# The seed's worked example: decode at the observed p99 batch (128) takes 2 + 128·0.0625 = 10 ms, so a
# 50 ms ITL target leaves 40 ms per step for prefill.
WORKED_EXAMPLE = LinearCost(a_ms=2.0, b_ms_per_token=0.03, c_ms_per_token_depth=2e-6, d_ms_per_decode=0.0625)


def synthetic_steps(
    cost: CostModel,
    *,
    n: int,
    chunk_sizes: Sequence[int],
    max_depth: int,
    decode_batches: Sequence[int],
    prefill_share: float = 0.6,
    noise_sigma: float = 0.03,
    stall_p: float = 0.002,
    seed: int = 0,
    t0: float = 1_700_000_000.0,
    first_seq: int = 1,
    kv_usage: float = 0.3,
    gap_s: float = 0.0,
) -> list[ev.Step]:
    """``n`` step events: a ``prefill_share`` of them run one chunk (a size from ``chunk_sizes`` at a
    depth that is a multiple of it, up to ``max_depth``) next to a decode batch from ``decode_batches``;
    the rest are decode-only. Durations are ``cost`` * log-normal noise, and a rare stall doubles one.
    Steps run back to back, ``gap_s`` apart."""
    rng = random.Random(seed)
    out: list[ev.Step] = []
    ts = t0
    for i in range(n):
        decodes = rng.choice(decode_batches)
        if rng.random() < prefill_share:
            tokens = rng.choice(chunk_sizes)
            depth = tokens * rng.randint(0, max(max_depth // tokens, 0))
        else:
            tokens = depth = 0
        duration = cost.cost_s(tokens, depth, decodes) * rng.lognormvariate(0.0, noise_sigma)
        if rng.random() < stall_p:
            duration *= 2.0
        out.append(
            ev.Step(
                seq=first_seq + i,
                ts=ts,
                step=i,
                duration_s=duration,
                prefill_tokens=tokens,
                decode_tokens=decodes,
                num_prefill_reqs=1 if tokens else 0,
                num_decode_reqs=decodes,
                running=decodes + (1 if tokens else 0),
                waiting=0,
                kv_usage=kv_usage,
                request_ids=[],
                prefill_depth_tokens=tokens * depth,
                max_prefill_depth=depth,
            )
        )
        ts += duration + gap_s  # the next step starts gap_s after this one ends (host work between)
    return out
