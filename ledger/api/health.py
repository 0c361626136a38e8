"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from ledger import migrate
from ledger.api.deps import StoreDep, WriterDep

router = APIRouter()
_HEAD = migrate.head_revision()


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
def readyz(store: StoreDep, writer: WriterDep) -> dict[str, Any] | JSONResponse:
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
    body = {"status": "ready" if not problems else "not ready", "schema": revision, "problems": problems}
    return body if not problems else JSONResponse(body, status_code=503)
