"""GET/PUT /v1/policy: the live runaway policy, versioned (admin token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from ledger.api.deps import require
from ledger.rules.policy import PolicyError, parse_policy
from ledger.rules.service import RunawayService

router = APIRouter()


def runaway(request: Request) -> RunawayService:
    return request.app.state.runaway  # type: ignore[no-any-return]


@router.get("/v1/policy", dependencies=[require("admin")])
async def get_policy(request: Request) -> dict[str, Any]:
    """The live policy: ``{"version", "created_ts", "origin", "policy"}``."""
    return runaway(request).policies.describe()


@router.put("/v1/policy", dependencies=[require("admin")])
async def put_policy(request: Request) -> Any:
    """Replace the policy with the JSON document in the body; answers the new version."""
    try:
        data = await request.json()
    except ValueError as exc:
        return JSONResponse({"detail": f"body: not valid JSON: {exc}"}, status_code=422)
    except RecursionError:
        return JSONResponse({"detail": "body: JSON nested deeper than the decoder allows"}, status_code=422)
    try:
        policy = parse_policy(data)
    except PolicyError as exc:
        return JSONResponse({"detail": f"policy rejected, nothing changed: {exc}"}, status_code=422)
    svc = runaway(request)
    await run_in_threadpool(svc.policies.put, policy, origin="api")
    return svc.policies.describe()
