"""GET /metrics: Prometheus text exposition.

Auth: with ``CHUNKLEDGER_METRICS_TOKEN`` set, that token (or the admin token) is required; otherwise
the read token is (open when that is empty, which only a loopback bind allows).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST

from ledger.api import errors
from ledger.api.deps import require

router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    dependencies=[require("metrics")],
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
async def metrics(request: Request) -> Response:
    """The ledger's Prometheus metrics (metrics token when set, else the read token)."""
    body = await run_in_threadpool(request.app.state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
