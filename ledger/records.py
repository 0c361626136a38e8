"""The answer records: what a route of the API answers, defined once as a msgspec Struct.

The domain (analytics, advice, ...) builds and returns these records; the API encodes them as they are
(:func:`ledger.api.answers.encoded`) and publishes their JSON Schema, generated from the same classes
(:mod:`ledger.api.openapi`), so the document cannot drift from the answer. A record refuses fields it
does not name (``additionalProperties: false`` in its schema); a field that only some answers carry is
``UNSET`` in the others and left out of their JSON.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

__all__ = ["UNSET", "Record", "UnsetType", "as_json"]


class Record(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of every answer record."""


def as_json(record: Any) -> Any:
    """The record as the API sends it, in plain Python (dicts, lists, numbers, strings)."""
    return msgspec.to_builtins(record)
