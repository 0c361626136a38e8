"""How a route answers with a record (:mod:`ledger.records`): the record encoded as it is, and the
document naming the record as the route's answer schema (``ledger.api.openapi`` generates the schema
from the record class, with every record a route names)."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import Response

from ledger.api import errors
from ledger.records import SCHEMA_REF as _REF
from ledger.rows import POSTED_BODIES

RECORDS: dict[str, type[Any]] = {}  # every record a route answers with, by its schema name
# Records a route's answer names only by reference (``ledger.rows.POSTED_BODIES``): in the document too.
RECORDS.update({b.__name__: b for b in POSTED_BODIES})


def encoded(record: Any, status_code: int = 200) -> Response:
    """``record`` as JSON (floats that are not finite as null), without validating it again."""
    return Response(msgspec.json.encode(record), status_code=status_code, media_type="application/json")


def documents(
    record: type[Any],
    *statuses: int,
    ok: int = 200,
    token: bool = True,
    more: dict[int, Any] | None = None,
    media: dict[str, Any] | None = None,
    description: str = "Successful Response",
) -> dict[str, Any]:
    """The route's arguments: its answer (status ``ok``) is ``record`` (for the document only:
    ``response_model`` is None, the record is sent as the route built it), and the error body for
    ``statuses`` and, behind a ``token``, its 401/403; ``more``: other documented answers; ``media``:
    other media types of the same answer."""
    name = record.__name__
    assert RECORDS.get(name, record) is record, f"two records named {name}"
    RECORDS[name] = record
    answer = {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF.format(name=name)}}, **(media or {})},
    }
    auth = errors.AUTH if token else ()
    return {
        "response_model": None,
        "responses": {ok: answer, **errors.responses(*auth, *statuses), **(more or {})},
    }
