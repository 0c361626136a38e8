"""The OpenAPI document: FastAPI's, plus what FastAPI cannot see.

``POST /v1/events`` decodes its body with msgspec (the wire contract) and ``PUT /v1/policy`` parses its
own JSON, so FastAPI knows neither body: their request schemas come from ``engine_hooks.events.Batch``
(msgspec's JSON Schema) and ``ledger.rules.policy.Policy`` (pydantic's). Error answers are documented as
they are sent: the ledger's own 4xx carry ``{"detail": "<field>: <reason>"}`` (a string; a refused batch
adds ``errors``, one per field), and a parameter FastAPI validates is answered with FastAPI's
``{"detail": [...]}`` list, so each 422 is one of the two.

The document is public, like ``/docs`` and ``/redoc``: it describes the API and holds no data, and a
browser opening ``/docs`` cannot send a bearer token. Every route that reads or writes data checks its
token as documented per route.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from engine_hooks import events as ev
from ledger.rules.policy import Policy

_REF = "#/components/schemas/{name}"

ERROR = {
    "title": "Error",
    "type": "object",
    "properties": {"detail": {"type": "string", "description": "what is wrong, naming the field"}},
    "required": ["detail"],
}
BATCH_REJECTED = {
    "title": "BatchRejected",
    "type": "object",
    "properties": {
        "detail": {"type": "string"},
        "errors": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "index": {"type": ["integer", "null"], "description": "event index; null: the batch"},
                    "field": {"type": "string"},
                    "reason": {"type": "string"},
                },
                "required": ["index", "field", "reason"],
            },
        },
    },
    "required": ["detail", "errors"],
}


def _json(ref: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": ref}}}}


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the completed document (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=__doc__)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        _, contract = msgspec.json.schema_components(
            [ev.Batch, ev.IngestResponse, ev.CommandsResponse], ref_template=_REF
        )
        schemas.update(contract)
        policy = Policy.model_json_schema(ref_template=_REF.replace("{name}", "{model}"))
        schemas.update(policy.pop("$defs", {}))
        schemas["Policy"] = policy
        schemas["Error"] = ERROR
        schemas["BatchRejected"] = BATCH_REJECTED
        paths = doc["paths"]

        events = paths["/v1/events"]["post"]
        events["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="Batch")}}},
        }
        events["responses"] = {
            "200": _json(_REF.format(name="IngestResponse"), "stored (durably) or already stored"),
            "401": _json(_REF.format(name="Error"), "missing or wrong ingest token"),
            "413": _json(_REF.format(name="Error"), "body larger than CHUNKLEDGER_MAX_BODY_BYTES"),
            "422": _json(_REF.format(name="BatchRejected"), "the batch is invalid; nothing of it stored"),
            "503": _json(_REF.format(name="Error"), "not stored: retry (Retry-After)"),
        }
        put = paths["/v1/policy"]["put"]
        put["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(name="Policy")}}},
        }
        put.setdefault("responses", {})["422"] = _json(
            _REF.format(name="Error"), "the policy is invalid; nothing changed"
        )
        either = {
            "oneOf": [{"$ref": _REF.format(name="Error")}, {"$ref": _REF.format(name="HTTPValidationError")}]
        }
        for path, item in paths.items():
            for method, op in item.items():
                if (path, method) in (("/v1/events", "post"), ("/v1/policy", "put")):
                    continue
                if "422" in op.get("responses", {}):
                    op["responses"]["422"]["content"] = {"application/json": {"schema": either}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
