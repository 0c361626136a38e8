"""What a what-if is asked: :class:`WhatIfQuery`, its defaults and limits in one place, and the engine
settings as users write them (``key=value[,key=value]``).

The API's query parameters are generated from the query's fields (names, defaults, limits,
descriptions: :mod:`ledger.api.queries`); the CLI builds the same query from its options;
:func:`ledger.whatif.service.what_if` checks it (:meth:`WhatIfQuery.checked`) and parses the settings
(:meth:`WhatIfQuery.candidates`, :meth:`WhatIfQuery.recorded_values`), each a :class:`WhatIfError`
(422) naming the field and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, get_type_hints

import msgspec
from msgspec import Meta

from engine_hooks.scheduling.settings import POLICIES, EngineSettings
from ledger.whatif.answer import WhatIfError

MAX_CANDIDATES = 32  # settings replayed in one answer at most
MAX_CALIBRATION_ERROR = 0.25  # refuse when replaying the recorded setting misses a tail by more
_HINTS = get_type_hints(EngineSettings)
SETTABLE: dict[str, type] = {f.name: _HINTS[f.name] for f in dataclasses.fields(EngineSettings)}
SettingValue = int | float | bool | str  # the types of EngineSettings's fields

_Time = Annotated[str, Meta(max_length=64, description="unix seconds, ISO 8601, or an age: 15m, 2h")]


class WhatIfQuery(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A what-if as asked: the settings to replay and the recorded one as users write them, the window,
    where the step time is fitted, the targets and the calibration's limit."""

    set: Annotated[
        list[str],
        Meta(
            max_length=MAX_CANDIDATES,
            description="a setting to replay, key=value[,key=value]; repeat for several",
        ),
    ] = []
    sweep: (
        Annotated[str, Meta(max_length=2000, description="one setting per value: key=v1,v2,...")] | None
    ) = None
    policy: (
        Annotated[str, Meta(max_length=32, description="fcfs, priority or kv-idle: every setting")] | None
    ) = None
    recorded: (
        Annotated[
            str, Meta(max_length=2000, description="the engine's settings in the window, key=value[,...]")
        ]
        | None
    ) = None
    model: (
        Annotated[str, Meta(min_length=1, max_length=256, description="served model (sources.model)")] | None
    ) = None
    source_id: Annotated[str, Meta(min_length=1, max_length=128, description="one engine source")] | None = (
        None
    )
    since: _Time | None = None
    until: Annotated[str, Meta(max_length=64)] | None = None
    long_prompt_tokens: Annotated[int, Meta(ge=1, le=10_000_000, description="long prompts")] | None = None
    itl_target_ms: Annotated[float, Meta(gt=0, le=600_000, description="mark settings meeting it")] | None = (
        None
    )
    ttft_target_ms: Annotated[float, Meta(gt=0, le=3_600_000, description="short TTFT p99 target")] | None = (
        None
    )
    max_error: Annotated[float, Meta(ge=0, le=100, description="largest calibration error")] = (
        MAX_CALIBRATION_ERROR
    )
    force: Annotated[bool, Meta(description="answer even when the calibration error is over max_error")] = (
        False
    )
    fit_source: (
        Annotated[
            str,
            Meta(
                min_length=1,
                max_length=128,
                description="fit step time on this engine's steps (a profile run)",
            ),
        ]
        | None
    ) = None
    fit_since: Annotated[str, Meta(max_length=64, description="fit step time on steps from then")] | None = (
        None
    )
    fit_until: Annotated[str, Meta(max_length=64, description="... until then")] | None = None
    attention_source: (
        Annotated[
            str,
            Meta(
                min_length=1,
                max_length=128,
                description="fit the attention inside a chunk on this engine's steps (a profile run), the "
                "rest on the window's",
            ),
        ]
        | None
    ) = None
    step_noise: Annotated[
        bool,
        Meta(
            description="each replayed decode-only step's time times a factor from the window's own steps' "
            "spread, and each step's engine-loop time before it as the window measured it"
        ),
    ] = True

    def checked(self) -> WhatIfQuery:
        """The query if every field is within its limits; else a WhatIfError (422, ``invalid``) naming
        the field and why (the API's parameters carry the same limits, checked before it is built)."""
        try:
            return msgspec.convert(msgspec.to_builtins(self), WhatIfQuery)
        except msgspec.ValidationError as exc:
            message = str(exc)
            reason, _, where = message.rpartition(" - at `$.")
            field = where.rstrip("`") if reason else "query"
            raise WhatIfError("invalid", f"{field}: {reason or message}", status=422) from None

    def params(self) -> dict[str, Any]:
        """The query as the API's parameters (every field; the client leaves out the nulls)."""
        out = msgspec.to_builtins(self)
        assert isinstance(out, dict)
        return out

    def candidates(self) -> list[dict[str, SettingValue]]:
        """The settings asked for (:func:`candidates_from`)."""
        return candidates_from(self.set, self.sweep, self.policy)

    def recorded_values(self) -> dict[str, SettingValue]:
        """The recorded settings given (the rest are inferred from the window)."""
        return parse_setting(self.recorded, where="recorded") if self.recorded else {}


# -- settings as users write them --------------------------------------------------------------------
def setting_text(values: Mapping[str, SettingValue]) -> str:
    """``{"max_num_batched_tokens": 512}`` -> ``"max_num_batched_tokens=512"`` (:func:`parse_setting`
    reads it back); a candidate's name."""
    return ",".join(f"{k}={v}" for k, v in values.items())


def parse_setting(text: str, *, where: str = "set") -> dict[str, SettingValue]:
    """``"max_num_batched_tokens=512,long_prefill_token_threshold=256"`` -> typed values; a
    WhatIfError (422) names the key and why otherwise."""
    out: dict[str, SettingValue] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, eq, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not key:
            raise WhatIfError("bad_setting", f"{where}: {part!r} is not key=value", status=422)
        out[key] = _value(key, raw, where)
    if not out:
        raise WhatIfError("bad_setting", f"{where}: empty: give key=value[,key=value]", status=422)
    return out


def parse_sweep(text: str) -> list[dict[str, SettingValue]]:
    """``"max_num_batched_tokens=256,512,1024"`` -> one setting per value."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not eq or not key or not values:
        raise WhatIfError("bad_setting", f"sweep: {text!r} is not key=v1,v2,...", status=422)
    return [{key: _value(key, v, "sweep")} for v in values]


def _value(key: str, raw: str, where: str) -> SettingValue:
    kind = SETTABLE.get(key)
    if kind is None:
        raise WhatIfError(
            "bad_setting",
            f"{where}: unknown setting {key!r}; known: {', '.join(SETTABLE)}",
            status=422,
        )
    if key == "policy" and raw not in POLICIES:  # checked here, before any replay runs
        raise WhatIfError(
            "bad_setting", f"{where}: unknown policy {raw!r} (known: {', '.join(POLICIES)})", status=422
        )
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "on")
        return kind(raw)
    except ValueError:
        raise WhatIfError(
            "bad_setting", f"{where}: {key}={raw!r} is not a {kind.__name__}", status=422
        ) from None


def candidates_from(
    sets: Sequence[str] = (), sweep: str | None = None, policy: str | None = None
) -> list[dict[str, SettingValue]]:
    """The settings asked for: one per ``set`` ("k=v[,k=v]"), one per value of ``sweep``
    ("k=v1,v2,..."); ``policy`` joins each of them (or is the one asked when there are none)."""
    asked = [parse_setting(s) for s in sets]
    if sweep:
        asked += parse_sweep(sweep)
    if policy is not None:
        _value("policy", policy, "policy")
        asked = [{**a, "policy": policy} for a in asked] or [{"policy": policy}]
    if not asked:
        raise WhatIfError("nothing_asked", "set, sweep or policy: say which settings to replay", status=422)
    if len(asked) > MAX_CANDIDATES:
        raise WhatIfError(
            "too_many_settings",
            f"{len(asked)} settings asked; at most {MAX_CANDIDATES} per answer",
            status=422,
        )
    return asked
