"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ledger import migrate
from ledger.api import errors
from ledger.api.deps import StoreDep, WriterDep
from ledger.api.models import Health, NotReady, Readiness

router = APIRouter(tags=["health"])
_HEAD = migrate.head_revision()


@router.get("/healthz", response_model=Health)
def healthz() -> dict[str, str]:
    """The process answers (no token)."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": NotReady, "description": "not ready: the problems say why"}},
)
def readyz(store: StoreDep, writer: WriterDep) -> dict[str, Any] | JSONResponse:
    """The database answers at the expected schema, the writer runs and its latest write succeeded (no
    token)."""
    problems = []
    try:
        store.ping()
        revision = migrate.current_revision(store.engine) if store.dialect != "null" else _HEAD
        if revision != _HEAD:
            problems.append(f"schema at {revision}, expected {_HEAD}")
    except Exception as exc:
        problems.append(f"database: {type(exc).__name__}: {exc}")
        revision = None
    if not writer.alive:
        problems.append("writer stopped")
    if writer.failing is not None:
        problems.append(f"storing batches fails: {writer.failing}")
    body: dict[str, Any] = {
        "status": "ready" if not problems else "not ready",
        "schema": revision,
        "problems": problems,
    }
    if not problems:
        return body
    return errors.error_response(503, "not ready: " + "; ".join(problems), reason="not_ready", **body)
