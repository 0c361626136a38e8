"""GET /metrics: Prometheus text exposition.

Auth: with ``CHUNKLEDGER_METRICS_TOKEN`` set, that token (or the admin token) is required; otherwise
the read token is (open when that is empty, which only a loopback bind allows).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST

from ledger import auth
from ledger.api import errors
from ledger.api.deps import SettingsDep

router = APIRouter(tags=["health"])


def _check(request: Request, settings: SettingsDep) -> None:
    if not settings.metrics_token:
        auth.check(settings, request, "read")
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    ok = scheme.lower() == "bearer" and any(
        t and hmac.compare_digest(token.encode(), t.encode())
        for t in (settings.metrics_token, settings.admin_token)
    )
    if not ok:
        raise errors.ApiError(
            401,
            "this endpoint needs the metrics token",
            reason="unknown_token" if scheme.lower() == "bearer" and token else "missing_token",
            headers={"WWW-Authenticate": "Bearer"},
        )


@router.get(
    "/metrics",
    response_model=None,
    response_class=Response,
    responses={
        200: {
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition (chunkledger_* families)",
        },
        **errors.responses(*errors.AUTH),
    },
)
async def metrics(request: Request, settings: SettingsDep) -> Response:
    """The ledger's Prometheus metrics (metrics token when set, else the read token)."""
    _check(request, settings)
    body = await run_in_threadpool(request.app.state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
