"""``chunkledger profile``'s report as records: the measured tables, the fit, the advice, and what was sent
to a ledger. :meth:`ledger.advice.profile.ProfileResult.report` builds it; the CLI prints it as JSON
(``as_json``) or as text (:func:`ledger.advice.report.render_profile`). No numpy, no store."""

from __future__ import annotations

import typing
from typing import Any

import msgspec

from engine_hooks.profile_run import Delivery
from ledger.advice.answer import Advice, FitSummary
from ledger.records import UNSET, Record, UnsetType


class PlanSummary(Record, kw_only=True):
    """The plan that ran (its cells; the rest of :class:`ledger.advice.profile.ProfilePlan` follows)."""

    chunk_sizes: list[int]
    max_depth: int
    decode_batches: list[int]
    repeats: int


class ChunkRow(Record, kw_only=True):
    """One (chunk size, decode batch) cell: the Theil-Sen line of step time over the depth of the long
    prompt's chunk steps (one chunk of exactly ``chunk_tokens`` next to the decodes)."""

    chunk_tokens: int
    decode_batch: int
    steps: int
    max_depth: int
    ms_at_depth_0: float
    ms_per_1k_depth: float


class DecodeRow(Record, kw_only=True):
    """The decode-only steps at one decode batch."""

    decode_batch: int
    steps: int
    p50_ms: float
    p99_ms: float


class Refused(Record, kw_only=True):
    """Why there is no fit or no advice: a short code and the explanation."""

    reason: str
    detail: str


def _without_fit() -> Any:
    """:class:`Advice` less its ``fit`` (the report shows the fit once, beside the tables), derived from
    Advice's own fields so that the two cannot drift apart."""
    hints = typing.get_type_hints(Advice, include_extras=True)
    fields = [(name, hints[name]) for name in Advice.__struct_fields__ if name != "fit"]
    record: Any = msgspec.defstruct("ProfileAdvice", fields, bases=(Record,), kw_only=True, module=__name__)
    record.__doc__ = "The advice for the profile's target, less its fit (the report's ``fit``)."
    return record


ProfileAdvice: Any = _without_fit()


def profile_advice(advice: Advice) -> Any:
    """``advice`` as the report carries it (a :data:`ProfileAdvice`)."""
    return ProfileAdvice(**{name: getattr(advice, name) for name in ProfileAdvice.__struct_fields__})


class ProfileReport(Record, kw_only=True):
    """What ``chunkledger profile`` reports: the measured tables, the fit of the steps (or why none) and,
    for a target, the advice (or why none)."""

    model: str
    source_id: str | None
    plan: PlanSummary
    steps: int
    wall_s: float  # time the plan's runs took (the warm-up and engine start not included)
    chunks: list[ChunkRow]
    decode: list[DecodeRow]
    ledger: Delivery | UnsetType = UNSET  # with a ledger URL
    fit: FitSummary | UnsetType = UNSET
    fit_error: Refused | UnsetType = UNSET
    advice: ProfileAdvice | UnsetType = UNSET  # type: ignore[valid-type]
    advice_error: Refused | UnsetType = UNSET


__all__ = [
    "ChunkRow",
    "DecodeRow",
    "PlanSummary",
    "ProfileAdvice",
    "ProfileReport",
    "Refused",
    "profile_advice",
]
