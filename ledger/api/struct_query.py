"""A route's query parameters from a msgspec Struct: one definition of their names, types, defaults,
limits and descriptions (the Struct's fields and their ``msgspec.Meta``), which FastAPI then checks and
documents like parameters written out (``Query(...)``), with the same 422 error body.

    QueryDep = Annotated[WhatIfQuery, Depends(struct_query(WhatIfQuery))]
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import Query

S = TypeVar("S", bound=msgspec.Struct)
_LIMITS = ("gt", "ge", "lt", "le", "min_length", "max_length", "description")


def _plain(tp: Any, metas: list[msgspec.Meta]) -> Any:
    """``tp`` without its ``Annotated`` layers (their Metas collected into ``metas``)."""
    if typing.get_origin(tp) is Annotated:
        base, *extra = typing.get_args(tp)
        metas.extend(m for m in extra if isinstance(m, msgspec.Meta))
        return _plain(base, metas)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = tuple(_plain(a, metas) for a in typing.get_args(tp))
        return typing.Union[members]  # noqa: UP007 (built from a tuple)
    return tp


def _parameter(field: msgspec.structs.FieldInfo) -> inspect.Parameter:
    metas: list[msgspec.Meta] = []
    annotation = _plain(field.type, metas)
    limits = {k: getattr(m, k) for m in metas for k in _LIMITS if getattr(m, k) is not None}
    default = field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
    return inspect.Parameter(
        field.name, inspect.Parameter.KEYWORD_ONLY, default=Query(default, **limits), annotation=annotation
    )


def struct_query(cls: type[S]) -> Callable[..., S]:
    """A FastAPI dependency that reads ``cls``'s fields from the query string and builds a ``cls``."""

    def parse(**values: Any) -> S:
        return cls(**values)

    parse.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [_parameter(f) for f in msgspec.structs.fields(cls)], return_annotation=cls
    )
    parse.__name__ = f"{cls.__name__}_query"
    return parse
