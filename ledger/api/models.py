"""The answers still described by pydantic models: the error bodies and the what-if. (The policy's
answer, ``PolicyVersion``, is the policy store's: ``ledger.rules.policy_store``.)

Every other answer is a record (:mod:`ledger.records`) whose schema is generated from it
(:mod:`ledger.api.answers`). The models here are declared as ``response_model`` (small answers, checked
as they go out) or only documented (``responses={200: {"model": ...}}``, the handler returning a
``Response``, see :func:`json_response`).

Every error answer is one :class:`ErrorBody` (``ledger.api.errors`` builds and sends it).
"""

from __future__ import annotations

from typing import Any

from fastapi import Response
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from pydantic.json_schema import SkipJsonSchema

_ANY = TypeAdapter(Any)


def json_response(content: Any, status_code: int = 200) -> Response:
    """``content`` as JSON, encoded as FastAPI encodes a ``dict[str, Any]`` answer (floats that are not
    finite as null, decimals as strings) without validating it first: for the large answers."""
    return Response(_ANY.dump_json(content), status_code=status_code, media_type="application/json")


# -- errors -----------------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    """Every error answer of the API (4xx and 5xx): a machine word, a readable detail, and, where there
    is a list, the list."""

    model_config = ConfigDict(extra="allow")

    reason: str = Field(
        description="short machine word: from the status (bad_request, unauthorized, forbidden, not_found, "
        "timeout, conflict, too_large, invalid, unavailable, internal) or the route's own "
        "(e.g. not_read_only, too_little_data, missing_token)",
        examples=["not_found"],
    )
    detail: str = Field(
        description="for people: what is wrong, naming the field (``field: message; field: message``)",
        examples=["no request 'r1' in the ledger"],
    )
    errors: list[dict[str, Any]] | SkipJsonSchema[None] = Field(
        None,
        description="only where there is a list: FastAPI's request validation errors (``loc``, ``msg``, "
        "``type``) on a 422 ``invalid``",
    )


class EventError(BaseModel):
    index: int | None = Field(description="the event's index in the batch; null: the batch itself")
    field: str = Field(description="the field at fault, e.g. events.3.ts or source.kind")
    reason: str = Field(description="why it was refused")


class BatchRejected(ErrorBody):
    """``POST /v1/events`` refused the batch: nothing of it was stored (fix it; do not resend it as is)."""

    errors: list[EventError] = Field(description="one per refused field")  # type: ignore[assignment]


class NotReady(ErrorBody):
    """``/readyz`` when the ledger cannot take events: its readiness body with the error fields."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    status: str = Field(description="not ready")
    schema_revision: str | None = Field(alias="schema", description="the database's migration revision")
    problems: list[str] = Field(description="what is wrong (the detail joins them)")


# -- export -----------------------------------------------------------------------------------------
PARQUET = "application/vnd.apache.parquet"  # GET /v1/export/{table}.parquet
