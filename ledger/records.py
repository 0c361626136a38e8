"""The answer records: what a route of the API answers, defined once as a msgspec Struct.

The domain (analytics, advice, ...) builds and returns these records; the API encodes them as they are
(:func:`ledger.api.answers.encoded`) and publishes their JSON Schema, generated from the same classes
(:mod:`ledger.api.openapi`), so the document cannot drift from the answer. A record refuses fields it
does not name (``additionalProperties: false`` in its schema); a field that only some answers carry is
``UNSET`` in the others and left out of their JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, UnsetType

__all__ = ["UNSET", "Record", "UnsetType", "as_json", "table_record"]


# Where the OpenAPI document keeps a record's schema (``ledger.api.openapi`` puts them there).
SCHEMA_REF = "#/components/schemas/{name}"


class Record(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every answer record."""


def as_json(record: Any) -> Any:
    """The record as the API sends it, in plain Python (dicts, lists, numbers, strings)."""
    return msgspec.to_builtins(record)


def _column_field(column: Any) -> tuple[str, Any]:
    """A table column (SQLAlchemy's) as a record field: its Python type, null when the column is
    nullable, described by the column's comment."""
    kind: Any = column.type.python_type
    if column.nullable and not column.primary_key:
        kind = kind | None
    if column.comment:
        kind = Annotated[kind, msgspec.Meta(description=column.comment)]
    return str(column.name), kind


def table_record(
    name: str,
    columns: Iterable[Any],
    *,
    module: str,
    doc: str,
    drop: Iterable[str] = (),
    types: Mapping[str, Any] | None = None,
    extra: Iterable[tuple[str, Any]] = (),
) -> Any:
    """A record whose fields are a table's ``columns`` (less ``drop``; ``types`` overrides a field's
    type), then ``extra``: the stored row as the API answers it, defined by the table itself. ``module``:
    where it is defined (its ``__module__``)."""
    types, dropped = dict(types or {}), set(drop)
    fields = []
    for column in columns:
        field_name, kind = _column_field(column)
        if field_name not in dropped:
            fields.append((field_name, types.get(field_name, kind)))
    record: Any = msgspec.defstruct(name, [*fields, *extra], bases=(Record,), kw_only=True, module=module)
    record.__doc__ = doc
    return record
