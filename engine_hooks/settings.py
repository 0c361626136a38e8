"""One loader for the engine-side settings: the exporter's, the gateway's and the vLLM plugin's options.

Each is a frozen msgspec Struct (no pydantic: these modules are imported inside inference engines).
Values come from keyword arguments, from ``PREFIX<NAME>`` environment variables, or from vLLM's
``additional_config``; every error names the variable, key or keyword that is wrong, and what it
expects, in the host's own exception type.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(var: str, value: str, error: type[Exception], *, empty: bool | None = None) -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case); an empty value is ``empty`` when
    given, else an error."""
    lowered = value.strip().lower()
    if lowered in TRUE:
        return True
    if lowered in FALSE:
        return False
    if not lowered and empty is not None:
        return empty
    raise error(f"{var} must be a boolean (1/0, true/false, yes/no, on/off), got {value!r}")


def from_environ(
    cls: type[S],
    prefix: str,
    environ: Mapping[str, str],
    parse: Callable[[str, str, str], Any],
) -> tuple[dict[str, Any], dict[str, str]]:
    """The fields of ``cls`` set as ``prefix + NAME`` in ``environ``, each through ``parse(name, var,
    value)``; returns the raw values and, per field, the variable it came from."""
    raw: dict[str, Any] = {}
    names: dict[str, str] = {}
    for field in msgspec.structs.fields(cls):
        var = prefix + field.name.upper()
        if var in environ:
            raw[field.name] = parse(field.name, var, environ[var])
            names[field.name] = var
    return raw, names


def is_bool_field(cls: type[msgspec.Struct], name: str) -> bool:
    return any(f.name == name and f.type is bool for f in msgspec.structs.fields(cls))


def convert(
    cls: type[S], raw: Mapping[str, Any], names: Mapping[str, str], *, what: str, error: type[Exception]
) -> S:
    """``raw`` validated into ``cls`` (strings converted laxly); an unknown key, a bad value or a failed
    cross-field check raises ``error`` naming it as ``names`` shows it (the variable, key or keyword).

    ``what`` names one setting, e.g. ``"exporter setting"``.
    """
    unknown = sorted(set(raw) - set(cls.__struct_fields__))
    if unknown:
        raise error(f"unknown {what}(s): {', '.join(unknown)}")
    try:
        return msgspec.convert(dict(raw), cls, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = re.search(r"at `\$\.(\w+)`", message)
        if match:
            field = match.group(1)
            shown = names.get(field, field)
            raise error(f"{shown}: {message.split(' - at ')[0]} (got {raw.get(field)!r})") from None
        for field, shown in names.items():  # cross-field checks name fields: show the variable instead
            message = re.sub(rf"\b{field}\b", shown, message)
        raise error(f"invalid {what}s: {message}") from None
