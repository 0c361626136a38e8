"""GET /metrics: Prometheus text exposition.

Auth: with ``CHUNKLEDGER_METRICS_TOKEN`` set, that token (or the admin token) is required; otherwise
the read token is (open when that is empty, which only a loopback bind allows).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST

from ledger import auth
from ledger.api.deps import SettingsDep

router = APIRouter()


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
        raise HTTPException(
            401, detail="this endpoint needs the metrics token", headers={"WWW-Authenticate": "Bearer"}
        )


@router.get("/metrics")
async def metrics(request: Request, settings: SettingsDep) -> Response:
    _check(request, settings)
    body = await run_in_threadpool(request.app.state.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
