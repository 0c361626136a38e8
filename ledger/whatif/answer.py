"""What a what-if answers: typed records (msgspec Structs), or :class:`WhatIfError` when there is none.

The service (:mod:`ledger.whatif.service`) returns a :class:`WhatIf`; the API encodes it as it is and
publishes its JSON Schema (msgspec's, every record closed: ``additionalProperties: false``); the CLI and
the dashboard decode the API's JSON back into it. Tails are seconds; a tail is null where there is
nothing to take one of (no long prompts: no long TTFT). Pure data: no numpy, no database.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, get_type_hints

import msgspec
from msgspec import UNSET, UnsetType

from engine_hooks.scheduling.settings import EngineSettings
from ledger.records import Record
from ledger.refusal import Refusal


class WhatIfError(Refusal):
    """No answer: ``reason`` is a short code, ``status`` the HTTP status the API answers with."""


def _settings_record(name: str, doc: str, *, partial: bool) -> type[msgspec.Struct]:
    """A record of :class:`EngineSettings`' fields (their names, types and order): every one, or (``partial``)
    only those given."""
    hints = get_type_hints(EngineSettings)
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        (f.name, hints[f.name] | UnsetType, UNSET) if partial else (f.name, hints[f.name])
        for f in dataclasses.fields(EngineSettings)
    ]
    cls = msgspec.defstruct(name, fields, bases=(Record,), module=__name__)
    cls.__doc__ = doc
    return cls


if TYPE_CHECKING:  # built from EngineSettings below: one definition of the settings' fields
    Settings = msgspec.Struct
    AskedSettings = msgspec.Struct
else:
    Settings = _settings_record(
        "Settings", "Every engine setting the replay ran under (EngineSettings)", partial=False
    )
    AskedSettings = _settings_record(
        "AskedSettings", "The engine settings asked for (the rest are the recorded setting's)", partial=True
    )


def settings_record(settings: EngineSettings) -> Settings:
    return Settings(**dataclasses.asdict(settings))


class Observed(Record):
    """What the window's steps say about the engine's settings (lower bounds: a budget or a running
    set that was never filled is not seen)."""

    max_step_tokens: int  # most tokens (prefill + decode) in one step: <= max_num_batched_tokens
    max_running: int  # most requests running after a step's scheduling: <= max_num_seqs
    max_kv_usage: float  # highest share of the KV cache in use
    max_chunk_tokens: int  # largest prefill chunk of one request (one-chunk steps)
    steps: int


class WindowFigures(Record):
    """What the replay read: the model's engines, the window, its finished requests (and how many of the
    others were skipped, per reason), what its steps show of the settings."""

    model: str | None
    source_ids: list[str]
    since: float | None
    until: float | None
    requests: int
    skipped: dict[str, int]
    observed: Observed


class Attention(Record):
    """The attention inside a chunk, fitted on another engine's steps (a profile run)."""

    source_id: str
    ms_per_token2_per_chunk: float
    steps: int
    prefill_tokens: list[float]  # the smallest and largest prefill of those steps


class Fit(Record):
    """The step-time fit the replay's step costs come from: its quality, terms and steps."""

    r2: float
    cv_rel_error: float
    terms: list[str]
    source_ids: list[str]
    since: float | None
    until: float | None
    steps: int
    attention: Attention | None


class Spread(Record):
    """Milliseconds: median, p99 and mean."""

    p50: float
    p99: float
    mean: float


class LoopTimes(Record):
    """The engine loop's time before a step (ms), after a decode-only step and after one with prefills,
    and per first token of the step before."""

    decode: Spread
    prefill: Spread
    per_first_token: float


class StepNoiseFigures(Record):
    """The factors each replayed decode-only step's fitted time was multiplied by (the window's
    decode-only steps' actual / fitted) and the loop time before each step; or why there were none
    (``applied`` false and ``why``, nothing else)."""

    applied: bool
    why: str | UnsetType = UNSET
    draws: int | UnsetType = UNSET
    decode_steps: int | UnsetType = UNSET
    mean: float | UnsetType = UNSET
    p50: float | UnsetType = UNSET
    p99: float | UnsetType = UNSET
    loop_ms: LoopTimes | UnsetType = UNSET


class _TailFields(Record):
    """The tails a replay predicts, one field each (long TTFT: the longest of the long prompts')."""

    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p99_s: float | None
    e2e_p99_s: float | None
    short_ttft_p99_s: float | None
    long_ttft_max_s: float | None


class Relative(_TailFields):
    """Each tail of a candidate relative to the recorded setting replayed (0.1: 10 % longer)."""


class CalibrationError(Record):
    """Each calibrated tail of the recorded setting replayed relative to the measured one."""

    ttft_p99_s: float | None
    itl_p99_s: float | None
    e2e_p99_s: float | None
    short_ttft_p99_s: float | None
    long_ttft_max_s: float | None


METRICS: tuple[str, ...] = Relative.__struct_fields__  # the tails a candidate is compared on
CALIBRATED: tuple[str, ...] = CalibrationError.__struct_fields__  # those the calibration checks


class ReplayTails(_TailFields):
    """A replay's tails in seconds, its preemptions and requests."""

    preemptions: int
    requests: int


class Calibration(Record):
    """The recorded setting (``inferred``: the settings read off the steps), measured vs replayed."""

    settings: Settings
    inferred: list[str]
    measured: ReplayTails
    predicted: ReplayTails
    error: CalibrationError
    max_error: float | None
    max_error_allowed: float


class Meets(Record):
    """Whether the predicted tails meet the targets given (only those given)."""

    itl: bool | UnsetType = UNSET
    ttft: bool | UnsetType = UNSET


class Candidate(Record):
    """One asked setting: its predicted tails, them relative to the recorded setting replayed, the
    targets met, what the replay asked of the fit beyond its data, on the frontier, the best."""

    name: str
    set: AskedSettings
    settings: Settings
    predicted: ReplayTails
    relative: Relative
    meets: Meets | None
    extrapolated: list[str]
    frontier: bool
    best: bool


class Targets(Record):
    itl_p99_ms: float | None
    short_ttft_p99_ms: float | None


class WhatIf(Record):
    """Predicted tails of the window's traffic under each asked setting, beside the recorded one."""

    window: WindowFigures
    fit: Fit
    step_noise: StepNoiseFigures
    long_prompt_tokens: int | None
    targets: Targets
    calibration: Calibration
    candidates: list[Candidate]
    elapsed_s: float


__all__ = [
    "CALIBRATED",
    "METRICS",
    "AskedSettings",
    "Attention",
    "Calibration",
    "CalibrationError",
    "Candidate",
    "Fit",
    "LoopTimes",
    "Meets",
    "Observed",
    "Relative",
    "ReplayTails",
    "Settings",
    "Spread",
    "StepNoiseFigures",
    "Targets",
    "WhatIf",
    "WhatIfError",
    "WindowFigures",
    "settings_record",
]
