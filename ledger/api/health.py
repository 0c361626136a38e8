"""Liveness and readiness."""

from __future__ import annotations

from typing import Annotated

import msgspec
from fastapi import APIRouter, Response

from ledger import migrate
from ledger.api import errors
from ledger.api.answers import documents, encoded
from ledger.api.deps import StoreDep, WriterDep
from ledger.api.models import NotReady
from ledger.records import Record


class Health(Record, kw_only=True):
    """``GET /healthz``."""

    status: Annotated[str, msgspec.Meta(description="ok: the process answers", examples=["ok"])]


class Readiness(Record, kw_only=True):
    """``GET /readyz`` when the ledger can take events."""

    status: Annotated[str, msgspec.Meta(description="ready")]
    schema: Annotated[str | None, msgspec.Meta(description="the database's migration revision")]
    problems: Annotated[list[str], msgspec.Meta(description="empty when ready")]


router = APIRouter(tags=["health"])
_HEAD = migrate.head_revision()


_HEALTHY = Health(status="ok")
_NOT_READY = {503: {"model": NotReady, "description": "not ready: the problems say why"}}


@router.get("/healthz", **documents(Health, token=False))
def healthz() -> Response:
    """The process answers (no token)."""
    return encoded(_HEALTHY)


@router.get("/readyz", **documents(Readiness, token=False, more=_NOT_READY))
def readyz(store: StoreDep, writer: WriterDep) -> Response:
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
    if not problems:
        return encoded(Readiness(status="ready", schema=revision, problems=problems))
    body = Readiness(status="not ready", schema=revision, problems=problems)
    detail = "not ready: " + "; ".join(problems)
    return errors.error_response(503, detail, reason="not_ready", **msgspec.structs.asdict(body))
