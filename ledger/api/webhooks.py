"""Webhook subscriptions and the delivery log (admin token)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ledger.api.deps import require
from ledger.api.policy import runaway
from ledger.webhooks.outbox import SubscriptionError, Webhooks

router = APIRouter(dependencies=[require("admin")])


class SubscriptionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=2048)
    secret: str = Field(min_length=16, max_length=512, description="HMAC key for the signature header")
    event_types: list[str] = Field(min_length=1, description="cutoff, slo_breach, starvation, data_loss")
    format: Literal["json", "text"] = "json"


def _hooks(request: Request) -> Webhooks:
    hooks = runaway(request).webhooks
    if hooks is None:
        raise HTTPException(409, detail="webhooks need a database (this ledger runs on null://)")
    return hooks


@router.get("/v1/webhooks")
async def list_webhooks(request: Request) -> dict[str, Any]:
    return {"webhooks": await run_in_threadpool(_hooks(request).subscriptions)}


@router.post("/v1/webhooks", status_code=201)
async def create_webhook(request: Request, body: SubscriptionIn) -> Any:
    try:
        return await run_in_threadpool(
            lambda: _hooks(request).create(
                url=body.url, secret=body.secret, event_types=body.event_types, format=body.format
            )
        )
    except SubscriptionError as exc:
        return JSONResponse({"detail": str(exc)}, status_code=422)


@router.delete("/v1/webhooks/{sub_id}")
async def delete_webhook(request: Request, sub_id: str) -> dict[str, Any]:
    if not await run_in_threadpool(_hooks(request).delete, sub_id):
        raise HTTPException(404, detail=f"no webhook subscription {sub_id!r}")
    return {"deleted": sub_id}


@router.get("/v1/webhooks/deliveries")
async def list_deliveries(
    request: Request,
    state: Annotated[Literal["pending", "delivered", "dead"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """Newest deliveries first, each with its attempt log (time, status code, error, duration)."""
    return {
        "deliveries": await run_in_threadpool(lambda: _hooks(request).deliveries(state=state, limit=limit))
    }
