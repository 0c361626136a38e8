"""Chunk-size advice's question and answer: :class:`AdviceQuery` (parsed by the API and the CLI alike;
its bounds and descriptions are the API's query parameters) and the :class:`ChunkSizeAdvice` record it
answers with (the API's schema is generated from it). No numpy, no store: the dashboard may decode it."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from ledger.advice.defaults import DEFAULT_ARRIVAL_SHARE, DEFAULT_MAX_STEPS, MIN_USEFUL_CHUNK
from ledger.records import UNSET, Record, UnsetType


def _d(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


_Target = Annotated[
    float, msgspec.Meta(gt=0, le=600_000, description="the inter-token latency p99 to stay within")
]
_Model = Annotated[
    str, msgspec.Meta(min_length=1, max_length=256, description="served model (sources.model)")
]
_Source = Annotated[str, msgspec.Meta(min_length=1, max_length=128, description="one engine source")]
_Since = Annotated[str, msgspec.Meta(max_length=64, description="unix seconds, ISO 8601, or an age: 15m, 2h")]
_Until = Annotated[str, msgspec.Meta(max_length=64, description="same forms as since; default now")]
_Depth = Annotated[int, msgspec.Meta(ge=0, description="advise at this prefill depth (default: p99 seen)")]
_Share = Annotated[
    float, msgspec.Meta(ge=0, lt=1, description="share of each step's prefill kept for arrivals")
]
_MaxSteps = Annotated[int, msgspec.Meta(ge=100, le=1_000_000, description="newest steps to fit on")]
_MinChunk = Annotated[
    int, msgspec.Meta(ge=1, le=1_000_000, description="refuse a target leaving fewer prefill tokens per step")
]


class AdviceQuery(msgspec.Struct, kw_only=True, frozen=True):
    """Advice for an ITL target: which steps to fit on, and how to advise."""

    itl_target_ms: _Target
    model: _Model | None = None
    source_id: _Source | None = None
    since: _Since | float | None = None
    until: _Until | float | None = None
    depth: _Depth | None = None
    arrival_share: _Share = DEFAULT_ARRIVAL_SHARE
    max_steps: _MaxSteps = DEFAULT_MAX_STEPS
    min_chunk: _MinChunk = MIN_USEFUL_CHUNK

    @classmethod
    def parse(cls, **raw: object) -> AdviceQuery:
        """The query from raw values (the CLI's options), checked against the bounds above; a value out
        of them is a ``ValueError`` naming the field."""
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ValueError(str(exc)) from None


# -- what the fit read and found --------------------------------------------------------------------
class StepWindowSummary(Record, kw_only=True):
    """The steps the fit read."""

    model: str | None
    source_ids: list[str]
    since: float | None
    until: float | None
    first_step_ts: float | None
    last_step_ts: float | None
    steps_read: int
    truncated: Annotated[bool, _d("the window held more than max_steps steps: only the newest were read")]


class CoefficientRow(Record, kw_only=True):
    term: str
    meaning: str
    ms_per_unit: float
    unit: str
    stderr_ms: float


class Residuals(Record, kw_only=True):
    """Signed residuals (actual - predicted), ms."""

    p50: float
    p99: float
    max: float


class Covers(Record, kw_only=True):
    """What the data covers (min, max); advice outside it is refused or capped."""

    steps: int
    prefill_steps: int
    decode_only_steps: int
    prefill_tokens: list[int]
    prefill_depth: list[int]
    decode_batch: list[int]
    duration_ms: list[float]


class TermChoice(Record, kw_only=True):
    """One step of the term selection: the term tried, whether it was kept, and the figures that decided."""

    term: str
    kept: bool
    cv_rel_error: float | UnsetType = UNSET
    cv_time_error: float | UnsetType = UNSET
    r2: float | UnsetType = UNSET
    residual_p99_ms: float | UnsetType = UNSET
    why: Annotated[str, _d("a term that could not be fitted")] | UnsetType = UNSET


class FitSummary(Record, kw_only=True):
    """The step-time fit: its terms, quality and coverage."""

    model: Annotated[str, _d("the terms kept, as a formula")]
    coefficients: list[CoefficientRow]
    r2: float
    residual_ms: Residuals
    cv_rel_error: Annotated[float, _d("cross-validated RMS of (actual - predicted) / predicted")]
    outliers_downweighted: int
    steps_used: int
    covers: Covers
    term_selection: list[TermChoice]


# -- the advice -------------------------------------------------------------------------------------
class StepMs(Record, kw_only=True):
    p50: float
    p99: float


class AdviceLoad(Record, kw_only=True):
    """The observed load the advice is for (quantiles over the window's steps)."""

    decode_batch_p50: int
    decode_batch_p99: int
    prefill_depth_p50: int
    prefill_depth_p99: int
    kv_usage_p99: float
    observed_step_p99_ms: float
    observed_decode_only_step_ms: StepMs | None


class DecodeMs(Record, kw_only=True):
    """Predicted decode-only step at the p50 and p99 decode batch."""

    at_p50_batch: float
    at_p99_batch: float


class BetweenSteps(Record, kw_only=True):
    """Host time between consecutive steps with decodes (ms), and the steps it was measured on."""

    p50: float
    p99: float
    steps: int


class DepthRow(Record, kw_only=True):
    """The largest prefill tokens per step within the target at one depth."""

    depth: int
    status: Literal["ok", "capped", "below_data", "unreachable"]
    chunk_tokens: int | None
    needed_tokens: Annotated[int | None, _d("below_data: what the fit says would fit (an extrapolation)")]
    predicted_step_p99_ms: float | None
    prefill_tokens_per_s: float | None
    unconstrained_tokens_per_s: float
    throughput_vs_unconstrained: float | None


class AdviceBasis(Record, kw_only=True):
    """What the advice stands on; a refusal carries it too (``advice`` in the error body)."""

    itl_target_ms: float
    load: AdviceLoad
    decode_ms: DecodeMs
    prefill_budget_ms: float
    margin_ms: float
    between_steps_ms: BetweenSteps
    margin_from: str
    depth: int
    by_depth: list[DepthRow]
    fit: FitSummary


class AdvisedSettings(Record, kw_only=True):
    """vLLM settings."""

    max_num_batched_tokens: int
    long_prefill_token_threshold: int


class Predicted(Record, kw_only=True):
    itl_p99_ms: float
    itl_p99_at_depth_0_ms: float


class Throughput(Record, kw_only=True):
    prefill_tokens_per_s: float | None
    unconstrained_tokens_per_s: float
    unconstrained_chunk_tokens: int
    cost: Annotated[float, _d("share of the prefill throughput the advice gives up")]
    long_prompt_tokens_per_s: float


class Advice(AdviceBasis, kw_only=True):
    """The settings for the target, from one fit and its load."""

    prefill_tokens_per_step: int
    settings: AdvisedSettings
    arrival_share: float
    predicted: Predicted
    throughput: Throughput
    notes: list[str]


class ChunkSizeAdvice(Advice, kw_only=True):
    """``GET /v1/advice/chunk-size``: engine settings for the ITL target, from the fitted step time,
    with the window of steps it was fitted on."""

    window: StepWindowSummary
