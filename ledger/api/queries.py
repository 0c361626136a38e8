"""Query objects (msgspec Structs of the domain: ``WhyQuery``, ``AdviceQuery``, ``WhatIfQuery``) as
FastAPI query parameters: each field's type, default, bounds and description come from the object, so
the API, the CLI and the function read one definition, and FastAPI checks the bounds and documents
them."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import Query

Q = TypeVar("Q", bound=msgspec.Struct)
_BOUNDS = ("gt", "ge", "lt", "le", "min_length", "max_length")


def _constraints(kind: Any) -> dict[str, Any]:
    """FastAPI's ``Query`` arguments for a msgspec field type (its Meta: bounds and description)."""
    out: dict[str, Any] = {}
    if isinstance(kind, msgspec.inspect.UnionType):  # X | None: the constraints are X's
        for member in kind.types:
            if not isinstance(member, msgspec.inspect.NoneType):
                out.update(_constraints(member))
        return out
    if isinstance(kind, msgspec.inspect.Metadata):
        if kind.extra_json_schema and "description" in kind.extra_json_schema:
            out["description"] = kind.extra_json_schema["description"]
        kind = kind.type
    out.update({k: getattr(kind, k) for k in _BOUNDS if getattr(kind, k, None) is not None})
    return out


def query_param(query: type[msgspec.Struct], field: str) -> Any:
    """A FastAPI query parameter for ``field`` of ``query`` (FastAPI takes the default from the
    signature, not from here)."""
    info = next(f for f in msgspec.inspect.type_info(query).fields if f.name == field)  # type: ignore[attr-defined]
    return Query(**_constraints(info.type))


def _default(field: Any) -> Any:
    """A field's default for the signature (a list's default comes from its factory)."""
    if field.required:
        return inspect.Parameter.empty
    return field.default if field.default is not msgspec.NODEFAULT else field.default_factory()


def query_dependency(query: type[Q]) -> Callable[..., Q]:
    """A FastAPI dependency that takes every field of ``query`` as a query parameter and builds it."""
    hints = typing.get_type_hints(query)  # the plain types: float, str | None, ...
    fields = msgspec.inspect.type_info(query).fields  # type: ignore[attr-defined]
    params = [
        inspect.Parameter(
            f.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=_default(f),
            annotation=Annotated[hints[f.name], Query(**_constraints(f.type))],
        )
        for f in fields
    ]

    def build(**values: Any) -> Q:
        return query(**values)

    build.__signature__ = inspect.Signature(params, return_annotation=query)  # type: ignore[attr-defined]
    build.__name__ = f"{query.__name__}_params"
    return build
