"""Webhook subscriptions and the delivery log (admin token)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from ledger.api import errors
from ledger.api.answers import documents, encoded
from ledger.api.deps import require
from ledger.api.policy import runaway
from ledger.rows import Deliveries, Webhook, WebhookDeleted, Webhooks
from ledger.webhooks.outbox import SubscriptionError
from ledger.webhooks.outbox import Webhooks as Outbox

router = APIRouter(prefix="/v1", tags=["webhooks"], dependencies=[require("admin")])


class SubscriptionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=1, max_length=2048)
    secret: str = Field(min_length=16, max_length=512, description="HMAC key for the signature header")
    event_types: list[str] = Field(min_length=1, description="cutoff, slo_breach, starvation, data_loss")
    format: Literal["json", "text"] = "json"


def _hooks(request: Request) -> Outbox:
    hooks = runaway(request).webhooks
    if hooks is None:
        raise errors.ApiError(
            409, "webhooks need a database (this ledger runs on null://)", reason="no_database"
        )
    return hooks


@router.get("/webhooks", **documents(Webhooks, 409))
async def list_webhooks(request: Request) -> Response:
    """The subscriptions (their secrets are never shown)."""
    rows = await run_in_threadpool(_hooks(request).subscriptions)
    return encoded(Webhooks(webhooks=rows))


@router.post("/webhooks", status_code=201, **documents(Webhook, 408, 409, 422, ok=201))
async def create_webhook(request: Request, body: SubscriptionIn) -> Response:
    """Subscribe a URL to event types; answers the subscription (without its secret)."""
    try:
        row = await run_in_threadpool(
            lambda: _hooks(request).create(
                url=body.url, secret=body.secret, event_types=body.event_types, format=body.format
            )
        )
    except SubscriptionError as exc:
        return errors.error_response(422, str(exc), reason="invalid")
    return encoded(row, status_code=201)


@router.delete("/webhooks/{sub_id}", **documents(WebhookDeleted, 404, 409, 422))
async def delete_webhook(request: Request, sub_id: str) -> Response:
    """Unsubscribe; its pending deliveries are dropped (dead)."""
    if not await run_in_threadpool(_hooks(request).delete, sub_id):
        raise errors.ApiError(404, f"no webhook subscription {sub_id!r}")
    return encoded(WebhookDeleted(deleted=sub_id))


@router.get("/webhooks/deliveries", **documents(Deliveries, 409, 422))
async def list_deliveries(
    request: Request,
    state: Annotated[Literal["pending", "delivered", "dead"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Response:
    """Newest deliveries first, each with its attempt log (time, status code, error, duration)."""
    rows = await run_in_threadpool(lambda: _hooks(request).deliveries(state=state, limit=limit))
    return encoded(Deliveries(deliveries=rows))
