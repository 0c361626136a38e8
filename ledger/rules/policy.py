"""The runaway policy: what the rules allow, per model, and what the alerts watch.

A policy is a validated document (TOML or YAML file, or JSON through ``PUT /v1/policy``)::

    [rules]                       # defaults for every model
    max_output_tokens = 16384     # ledger-side output cap, also where the client set none
    wall_clock_timeout_s = 1800   # admission -> drain
    stall_timeout_s = 120         # no new token for this long while running
    max_preemptions = 3           # then preemption_action
    max_forced_waits = 2000       # steps sat out while holding KV; then preemption_action
    preemption_action = "slow_pool"   # or "non_preemptible"
    slow_pool_max_wait_s = 60     # starved this long in the slow pool -> promote
    [rules.loop]                  # exact loops: a block of up to max_period tokens repeated
    max_period = 512
    min_repeats = 2
    min_span_tokens = 64          # and min_repeats * period + confirm_tokens
    confirm_tokens = 16
    [rules.near_loop]             # the same block with one token changed per repeat (a counter)
    min_span_tokens = 768         # a table whose rows differ in one cell is one, for a while
    [rules.paraphrase_loop]       # the same steps re-worded again and again
    enabled = false

    [models."llama-3-8b".rules]   # any subset of [rules], merged over the defaults
    max_output_tokens = 4096

    [alerts]
    starvation_wait_s = 60
    [alerts.slo]                  # per-model targets can go in [models.X.slo]
    ttft_p99_s = 2.0
    itl_p99_s = 0.2

Every limit accepts ``0`` / ``false`` to switch that rule off (``null`` in JSON). Unknown keys are
errors, so a typo never silently disables a rule. Loop defaults were chosen by measurement on
``tools.loop_corpus`` (``python -m bench.loopdetect``): a loop must span ``max(64, 2p + 16)`` tokens for
a block of ``p`` (a legitimate JSON array of flags repeats a 30-token pattern over 68 tokens, arrays of
zeros a 2-token one over 62); a near-loop 768 (legitimate rows that differ in one cell run to 498).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidatorFunctionWrapHandler,
    create_model,
    field_validator,
    model_serializer,
)
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonDict

Action = Literal["slow_pool", "non_preemptible"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _off(v: Any) -> Any:
    """0 and false switch a limit off (TOML has no null)."""
    return None if v is False or (v == 0 and not isinstance(v, bool)) else v


class LoopSettings(_Strict):
    enabled: bool = True
    max_period: int = Field(512, ge=1, le=2048, description="longest repeated block looked for, in tokens")
    min_repeats: int = Field(2, ge=2, le=10_000, description="repeats of the block at the tail")
    min_span_tokens: int = Field(64, ge=2, le=100_000, description="and the repeated tail at least this long")
    confirm_tokens: int = Field(
        16, ge=0, le=100_000, description="and this many tokens past the last of the min_repeats repeats"
    )


class NearLoopSettings(_Strict):
    """Near-loops: a block repeated with at most one token changed per repeat (a counter)."""

    enabled: bool = True
    min_period: int = Field(4, ge=2, le=2048, description="shortest block (short ones: every list)")
    max_period: int = Field(512, ge=2, le=2048, description="longest repeated block looked for, in tokens")
    min_repeats: int = Field(4, ge=2, le=10_000, description="repeats of the block at the tail")
    min_span_tokens: int = Field(
        768, ge=2, le=100_000, description="and the repeated tail at least this long"
    )

    @field_validator("max_period")
    @classmethod
    def _periods(cls, v: int, info: Any) -> int:
        lo = info.data.get("min_period")
        if lo is not None and v < lo:
            raise ValueError(f"max_period ({v}) must be at least min_period ({lo})")
        return v


class ParaphraseLoopSettings(_Strict):
    """Paraphrase loops: the recent output re-says, in other words, what was said several times before
    (off by default; ``ledger.rules.paraphrase``)."""

    enabled: bool = False
    ngram: int = Field(4, ge=1, le=8, description="tokens per phrase")
    min_seen: int = Field(3, ge=1, le=1000, description="a phrase said this many times before recurs")
    window: int = Field(256, ge=16, le=4096, description="recent tokens looked at")
    min_recurrent_ratio: float = Field(
        0.8, gt=0, le=1, description="share of the window's phrases that recur"
    )
    min_jumps: int = Field(24, ge=0, le=4096, description="recurring phrases copied from another place")
    min_vocabulary: int = Field(64, ge=0, le=4096, description="distinct tokens ending a recurring phrase")


class RuleSettings(_Strict):
    max_output_tokens: int | None = Field(16384, ge=1)
    wall_clock_timeout_s: float | None = Field(1800.0, gt=0)
    stall_timeout_s: float | None = Field(120.0, gt=0)
    max_preemptions: int | None = Field(3, ge=1)
    max_forced_waits: int | None = Field(2000, ge=1)
    preemption_action: Action = "slow_pool"
    slow_pool_max_wait_s: float | None = Field(60.0, gt=0)
    loop: LoopSettings = LoopSettings()
    near_loop: NearLoopSettings = NearLoopSettings()
    paraphrase_loop: ParaphraseLoopSettings = ParaphraseLoopSettings()

    @field_validator(
        "max_output_tokens",
        "wall_clock_timeout_s",
        "stall_timeout_s",
        "max_preemptions",
        "max_forced_waits",
        "slow_pool_max_wait_s",
        mode="before",
    )
    @classmethod
    def _switch_off(cls, v: Any) -> Any:
        return _off(v)


class SloSettings(_Strict):
    ttft_p99_s: float | None = Field(
        None, gt=0, description="TTFT p99 target (as the client saw it where a gateway measured it)"
    )
    itl_p99_s: float | None = Field(None, gt=0, description="inter-token latency p99 target")

    @field_validator("ttft_p99_s", "itl_p99_s", mode="before")
    @classmethod
    def _switch_off(cls, v: Any) -> Any:
        return _off(v)


class AlertSettings(_Strict):
    starvation_wait_s: float | None = Field(60.0, gt=0, description="a request waiting longer: starvation")
    slo: SloSettings = SloSettings()
    slo_window_s: float = Field(300.0, gt=0, description="sliding window of finished requests")
    slo_min_samples: int = Field(20, ge=1, description="no verdict on fewer requests in the window")
    slo_clear_ratio: float = Field(0.8, gt=0, lt=1, description="clears when p99 < target * this")
    slo_check_interval_s: float = Field(10.0, gt=0)

    @field_validator("starvation_wait_s", mode="before")
    @classmethod
    def _switch_off(cls, v: Any) -> Any:
        return _off(v)


class CommandSettings(_Strict):
    ttl_s: float = Field(600.0, gt=0, description="stop re-sending an unconfirmed command after this")


class _Partial(_Strict):
    """Base of the partial settings (:func:`_partial`): a field not given is not set, and is left out
    when the model is dumped (so a dumped override parses back to the same override)."""

    @model_serializer(mode="wrap")
    def _given(self, handler: SerializerFunctionWrapHandler) -> Any:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


def _no_default(schema: JsonDict) -> None:
    schema.pop("default", None)  # a field not given keeps the value it overrides: it has no default


def _partial(cls: type[_Strict]) -> Any:
    """``cls`` with every field optional: the same names, types, constraints, descriptions and field
    validators, nested settings partial too; unknown fields refused. Only the fields given are set."""
    if cls.__pydantic_decorators__.model_validators:
        raise TypeError(f"{cls.__name__}: model validators would not see a partial model's missing fields")
    fields: dict[str, tuple[Any, FieldInfo]] = {}
    for name, f in cls.model_fields.items():
        kind, default = f.annotation, None
        if isinstance(kind, type) and issubclass(kind, _Strict):
            kind = _partial(kind)
            default = kind()  # nested settings: none of their fields set
        fields[name] = (kind, FieldInfo.merge_field_infos(f, default=default, json_schema_extra=_no_default))
    validators: dict[str, classmethod[Any, Any, Any]] = {}
    for d in cls.__pydantic_decorators__.field_validators.values():
        own = d.func.__func__  # type: ignore[attr-defined]  # pydantic holds it bound to ``cls``
        validators[d.cls_var_name] = field_validator(*d.info.fields, mode=d.info.mode)(classmethod(own))
    return create_model(  # type: ignore[call-overload]
        f"Partial{cls.__name__}",
        __base__=_Partial,
        __module__=__name__,
        __doc__=f"Any subset of {cls.__name__}'s fields, merged over it.",
        __validators__=validators,
        **fields,
    )


PartialRuleSettings: Any = _partial(RuleSettings)
PartialSloSettings: Any = _partial(SloSettings)


class ModelOverride(_Strict):
    """One model's overrides: any subset of ``[rules]`` and of ``[alerts.slo]``."""

    rules: PartialRuleSettings = PartialRuleSettings()  # type: ignore[valid-type]
    slo: PartialSloSettings = PartialSloSettings()  # type: ignore[valid-type]


class Policy(_Strict):
    rules: RuleSettings = RuleSettings()
    models: dict[str, ModelOverride] = {}
    alerts: AlertSettings = AlertSettings()
    commands: CommandSettings = CommandSettings()

    @field_validator("models", mode="wrap")
    @classmethod
    def _overrides_validate(
        cls, v: Any, handler: ValidatorFunctionWrapHandler, info: Any
    ) -> dict[str, ModelOverride]:
        try:
            models: dict[str, ModelOverride] = handler(v)
        except ValidationError as exc:
            raise ValueError(_override_errors(exc)) from None
        base = info.data.get("rules", RuleSettings())
        for name, ov in models.items():
            try:
                _merge(base, ov.rules)
                _merge(SloSettings(), ov.slo)
            except ValidationError as exc:
                raise ValueError(f"models.{name}: {format_errors(exc)}") from None
        return models

    def rules_for(self, model: str | None) -> RuleSettings:
        ov = self.models.get(model or "")
        return self.rules if ov is None else _merge(self.rules, ov.rules)

    def slo_for(self, model: str | None) -> SloSettings:
        ov = self.models.get(model or "")
        return self.alerts.slo if ov is None else _merge(self.alerts.slo, ov.slo)


S = TypeVar("S", bound=_Strict)


def _merge(base: S, override: _Partial) -> S:
    """``base`` with the fields ``override`` sets (nested settings merged field by field), validated."""
    if not override.model_fields_set:
        return base
    data = base.model_dump()
    for k, v in override.model_dump().items():  # only the fields it sets
        data[k] = {**data[k], **v} if isinstance(v, dict) else v
    return type(base).model_validate(data)


class PolicyError(ValueError):
    """A policy that does not validate; the message names each field and the reason."""


def _override_errors(exc: ValidationError) -> str:
    """The errors of ``models`` as ``models.<name>: <field>: <reason>``, the field named within its
    section (``rules`` or ``slo``) as the merged settings name it."""
    parts = []
    for e in exc.errors():
        loc = [str(x) for x in e["loc"]]
        if len(loc) > 2 and loc[1] in ("rules", "slo"):
            del loc[1]
        name, field = (f"models.{loc[0]}", ".".join(loc[1:])) if loc else ("models", "")
        parts.append(f"{name}: {field}: {e['msg']}" if field else f"{name}: {e['msg']}")
    return "; ".join(parts)


def format_errors(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "policy"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)


def parse_policy(data: Any) -> Policy:
    """Validate a decoded document; raise PolicyError naming the field."""
    if not isinstance(data, dict):
        raise PolicyError("policy: must be a mapping (a TOML/YAML document or a JSON object)")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(format_errors(exc)) from None


def load_policy_text(text: str, fmt: str) -> Policy:
    """Parse ``text`` as ``toml``, ``yaml`` or ``json`` and validate it."""
    try:
        if fmt == "toml":
            data: Any = tomllib.loads(text)
        elif fmt in ("yaml", "yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif fmt == "json":
            data = json.loads(text)
        else:
            raise PolicyError(f"policy: unknown format {fmt!r}; use .toml, .yaml or .json")
    except PolicyError:
        raise
    except Exception as exc:  # the parsers' own errors carry line and column
        raise PolicyError(f"policy: not valid {fmt}: {exc}") from None
    return parse_policy(data)


def load_policy_file(path: str | Path) -> Policy:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise PolicyError(f"policy file {p}: {exc.strerror}") from None
    try:
        return load_policy_text(text, p.suffix.lstrip(".").lower() or "toml")
    except PolicyError as exc:
        raise PolicyError(f"policy file {p}: {exc}") from None


def policy_json(policy: Policy) -> str:
    """The policy as it is stored: JSON, keys sorted (a model's overrides: only the fields they set)."""
    return json.dumps(policy.model_dump(mode="json"), sort_keys=True)
