"""GET /metrics: Prometheus text exposition, or OpenMetrics (with exemplars) when the scraper asks for it.

Auth: with ``CHUNKLEDGER_METRICS_TOKEN`` set, that token (or the admin token) is required; otherwise
the read token is (open when that is empty, which only a loopback bind allows).
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS

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
            "content": {
                CONTENT_TYPE_LATEST: {"schema": {"type": "string"}},
                OPENMETRICS: {"schema": {"type": "string"}},
            },
            "description": "Prometheus text exposition (chunkledger_* families); OpenMetrics, whose "
            "latency histograms carry exemplars (request_id, trace_id), for an Accept that names it",
        },
        **errors.responses(*errors.AUTH),
    },
)
async def metrics(request: Request) -> Response:
    """The ledger's Prometheus metrics (metrics token when set, else the read token); OpenMetrics with
    exemplars when ``Accept`` names ``application/openmetrics-text`` (Prometheus does)."""
    openmetrics = "application/openmetrics-text" in request.headers.get("accept", "")
    body = await run_in_threadpool(request.app.state.metrics.render, openmetrics)
    return Response(body, media_type=OPENMETRICS if openmetrics else CONTENT_TYPE_LATEST)
