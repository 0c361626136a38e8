"""The OpenAPI document: FastAPI's, plus what FastAPI cannot see.

``POST /v1/events`` decodes its body with msgspec (the wire contract) and ``PUT /v1/policy`` parses its
own JSON, so FastAPI knows neither body: their request schemas come from ``engine_hooks.events.Batch``
(msgspec's JSON Schema) and ``ledger.rules.policy.Policy`` (pydantic's), and the answers of
``POST /v1/events`` and ``GET /v1/commands`` from the contract's ``IngestResponse`` and
``CommandsResponse``. An answer the domain builds as a record (:mod:`ledger.records`) has the schema
msgspec generates from that record (``ledger.api.answers.documents`` names it); the others are still
pydantic models of ``ledger.api.models``.

Every error answer is one body, ``ErrorBody``: ``{"reason": "<machine word>", "detail": "<field>:
<reason>"}``, with ``errors`` where there is a list (FastAPI's validation errors on a 422 ``invalid``;
a refused batch's per-event errors, ``BatchRejected``). Each route documents the statuses it can give.

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
from engine_hooks.columnar import MEDIA_TYPE, WIRE_VERSION
from ledger.api.answers import RECORDS
from ledger.records import SCHEMA_REF as _REF
from ledger.rules.policy import Policy

TAGS = [
    {"name": "ingest", "description": "sources send their events (ingest token)"},
    {"name": "requests", "description": "one request's row and timeline, the sources (read token)"},
    {"name": "analytics", "description": "tails, request lists, ITL, why, KV stalls (read token)"},
    {"name": "rules", "description": "runaway policy (admin), commands (ingest), cutoffs (read)"},
    {"name": "webhooks", "description": "subscriptions and the delivery log (admin token)"},
    {"name": "sql", "description": "read-only SQL and Parquet export (read token)"},
    {"name": "advice", "description": "chunked-prefill settings for an ITL target (read token)"},
    {"name": "whatif", "description": "the recorded traffic replayed under other settings (read token)"},
    {"name": "health", "description": "liveness, readiness, Prometheus metrics"},
]


def _json(name: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": _REF.format(name=name)}}},
    }


def _body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": _REF.format(name=name)}}}}


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` return the completed document (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, routes=app.routes, description=__doc__, tags=TAGS
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        _, contract = msgspec.json.schema_components(
            [ev.Batch, ev.IngestResponse, ev.CommandsResponse, *RECORDS.values()], ref_template=_REF
        )
        clash = set(contract) & set(schemas)
        assert not clash, f"the records' schema names clash with the API's models: {sorted(clash)}"
        schemas.update(contract)
        policy = Policy.model_json_schema(ref_template=_REF.replace("{name}", "{model}"))
        schemas.update(policy.pop("$defs", {}))
        schemas["Policy"] = policy
        paths = doc["paths"]

        events = paths["/v1/events"]["post"]
        events["requestBody"] = _body("Batch")
        events["requestBody"]["content"][MEDIA_TYPE] = {
            "schema": {
                "type": "string",
                "format": "binary",
                "description": f"the columnar message, wire version {WIRE_VERSION} (msgpack: "
                "engine_hooks/columnar.py, docs/reference/events.md#the-columnar-message): the same events, "
                "its steps as packed columns",
            }
        }
        events["responses"]["200"] = _json("IngestResponse", "stored (durably) or already stored")
        paths["/v1/commands"]["get"]["responses"]["200"] = _json(
            "CommandsResponse", "the source's unconfirmed commands (re-sent until confirmed)"
        )
        paths["/v1/policy"]["put"]["requestBody"] = _body("Policy")
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
