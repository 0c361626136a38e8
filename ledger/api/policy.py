"""GET/PUT /v1/policy: the live runaway policy, versioned (admin token)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from ledger.api import errors
from ledger.api.deps import require
from ledger.rules.policy import PolicyError, parse_policy
from ledger.rules.policy_store import PolicyVersion
from ledger.runaway import RunawayService

router = APIRouter(prefix="/v1", tags=["rules"])


def runaway(request: Request) -> RunawayService:
    return request.app.state.runaway  # type: ignore[no-any-return]


@router.get(
    "/policy",
    dependencies=[require("admin")],
    response_model=PolicyVersion,
    responses=errors.responses(*errors.AUTH),
)
async def get_policy(request: Request) -> PolicyVersion:
    """The live policy: ``{"version", "created_ts", "origin", "policy"}``."""
    return runaway(request).policies.describe()


# The body is parsed here (a policy file's rules, with their errors): ``ledger.api.openapi`` names its
# schema (Policy).
@router.put(
    "/policy",
    dependencies=[require("admin")],
    response_model=PolicyVersion,
    responses=errors.responses(*errors.AUTH, 408, 422),
)
async def put_policy(request: Request) -> Any:
    """Replace the policy with the JSON document in the body; answers the new version."""
    try:
        data = await request.json()
    except ValueError as exc:
        return errors.error_response(422, f"body: not valid JSON: {exc}", reason="invalid")
    except RecursionError:
        detail = "body: JSON nested deeper than the decoder allows"
        return errors.error_response(422, detail, reason="invalid")
    try:
        policy = parse_policy(data)
    except PolicyError as exc:
        return errors.error_response(422, f"policy rejected, nothing changed: {exc}", reason="invalid")
    svc = runaway(request)
    await run_in_threadpool(svc.policies.put, policy, origin="api")
    return svc.policies.describe()
