"""The step-time model's design: the ``steps`` columns it reads (:class:`StepData`) and the terms of the
fit built from them (:data:`TERMS`; :mod:`ledger.advice.fit` says which are always in and which are
candidates)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ledger.store.step_memory import MAX_STEP_GAP_S

COLUMNS = (
    "duration_s",
    "prefill_tokens",
    "prefill_depth_tokens",
    "max_prefill_depth",
    "num_prefill_reqs",
    "num_decode_reqs",
    "kv_usage",
    "interval_s",
)
OPTIONAL = {"interval_s"}  # NaN when unknown (steps not read from the ledger)


@dataclass(frozen=True)
class StepData:
    """Columns of ``steps`` rows as float arrays (one entry per step)."""

    duration_s: np.ndarray
    prefill_tokens: np.ndarray
    prefill_depth_tokens: np.ndarray
    max_prefill_depth: np.ndarray
    num_prefill_reqs: np.ndarray
    num_decode_reqs: np.ndarray
    kv_usage: np.ndarray
    interval_s: np.ndarray  # end of the engine's previous step to the end of this one (ingest); NaN unknown

    @classmethod
    def from_columns(cls, cols: Mapping[str, ArrayLike]) -> StepData:
        """From one sequence of numbers per column (``interval_s`` may be left out: NaN)."""
        n_rows = len(np.asarray(cols["duration_s"]))
        arrays = {
            c: np.asarray(cols[c], dtype=np.float64)
            if c in cols or c not in OPTIONAL
            else np.full(n_rows, np.nan)
            for c in COLUMNS
        }
        n = {len(a) for a in arrays.values()}
        if len(n) > 1:
            raise ValueError(f"columns of different lengths: {sorted(n)}")
        return cls(**arrays)

    @classmethod
    def from_steps(cls, steps: Sequence[Any]) -> StepData:
        """From ``step`` events of one source in emit order, with ``interval_s`` as the ledger computes
        it at ingest (``ledger.store.base``: end of the previous step to the end of this one, when the
        previous is numbered one less and scheduled at most ``MAX_STEP_GAP_S`` apart)."""
        cols: dict[str, list[float]] = {
            c: [getattr(s, c) for s in steps] for c in COLUMNS if c not in OPTIONAL
        }
        interval: list[float] = []
        prev = None
        for s in steps:
            end = s.ts + s.duration_s
            follows = prev is not None and prev[0] == s.step - 1 and abs(s.ts - prev[1]) <= MAX_STEP_GAP_S
            interval.append(end - prev[2] if follows and prev is not None else np.nan)
            prev = (s.step, s.ts, end)
        cols["interval_s"] = interval
        return cls.from_columns(cols)

    @classmethod
    def from_rows(cls, rows: list[tuple[Any, ...]] | list[Any]) -> StepData:
        """Rows in ``COLUMNS`` order (e.g. a database cursor's tuples; NULL becomes NaN)."""
        if not rows:
            return cls.from_columns({c: [] for c in COLUMNS})
        arr = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(COLUMNS))
        return cls(**{c: arr[:, i] for i, c in enumerate(COLUMNS)})

    def __len__(self) -> int:
        return len(self.duration_s)

    def select(self, mask: np.ndarray) -> StepData:
        return StepData(**{c: getattr(self, c)[mask] for c in COLUMNS})

    @property
    def is_prefill(self) -> np.ndarray:
        return self.prefill_tokens > 0


@dataclass(frozen=True)
class Term:
    """One column of the design matrix, and its value for a hypothetical one-chunk step."""

    name: str
    doc: str
    unit: str  # what one unit of the term is, for the coefficient's label ("ms per <unit>")
    column: Callable[[StepData], np.ndarray]
    # value for a step with one prefill chunk of `tokens` at `depth`, `decode` decodes, KV usage `kv`
    single: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def _sq_per_chunk(d: StepData) -> np.ndarray:
    return d.prefill_tokens**2 / np.maximum(d.num_prefill_reqs, 1.0)


INTERCEPT = Term(
    "intercept",
    "fixed cost of a step",
    "step",
    lambda d: np.ones(len(d)),
    lambda t, dep, b, kv: np.ones_like(t, dtype=np.float64),
)
BASE_TERMS = (
    INTERCEPT,
    Term(
        "prefill_tokens",
        "per prefill token",
        "token",
        lambda d: d.prefill_tokens,
        lambda t, dep, b, kv: t,
    ),
    Term(
        "prefill_depth_tokens",
        "per prefill token per token of depth (attention over the prefix)",
        "token·depth",
        lambda d: d.prefill_depth_tokens,
        lambda t, dep, b, kv: t * dep,
    ),
    Term(
        "num_decode_reqs",
        "per decoding request",
        "decode",
        lambda d: d.num_decode_reqs,
        lambda t, dep, b, kv: b,
    ),
)
CANDIDATE_TERMS = (
    Term(
        "num_prefill_reqs",
        "per prefill chunk",
        "chunk",
        lambda d: d.num_prefill_reqs,
        lambda t, dep, b, kv: (t > 0).astype(np.float64),
    ),
    Term(
        "max_prefill_depth",
        "per token of depth, per chunk (reading the prefix's KV)",
        "depth token",
        lambda d: d.max_prefill_depth,
        lambda t, dep, b, kv: np.where(t > 0, dep, 0.0),
    ),
    Term(
        "prefill_tokens_sq",
        "per token² within a chunk (attention inside the chunk)",
        "token²",
        _sq_per_chunk,
        lambda t, dep, b, kv: t * t,
    ),
    Term(
        "kv_usage",
        "per unit of KV cache usage (decode attention over the context held)",
        "kv_usage",
        lambda d: d.kv_usage,
        lambda t, dep, b, kv: kv,
    ),
)
TERMS = {t.name: t for t in (*BASE_TERMS, *CANDIDATE_TERMS)}
