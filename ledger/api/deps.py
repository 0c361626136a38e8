"""FastAPI dependencies as Annotated aliases (async: FastAPI runs a plain ``def`` dependency on a worker
thread, and ingest must not wait for one behind slow reads)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from ledger import auth
from ledger.config import Settings
from ledger.ingest import IngestWriter
from ledger.producers import ProducerBook
from ledger.reads import Reads
from ledger.store import Store


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def get_store(request: Request) -> Store:
    return request.app.state.store  # type: ignore[no-any-return]


async def get_writer(request: Request) -> IngestWriter:
    return request.app.state.writer  # type: ignore[no-any-return]


async def get_reads(request: Request) -> Reads:
    return request.app.state.reads  # type: ignore[no-any-return]


async def get_producers(request: Request) -> ProducerBook:
    return request.app.state.producers  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
WriterDep = Annotated[IngestWriter, Depends(get_writer)]
ReadsDep = Annotated[Reads, Depends(get_reads)]
ProducersDep = Annotated[ProducerBook, Depends(get_producers)]

ROLE_ATTR = "chunkledger_role"
T = TypeVar("T")


def on_ingest_pool(request: Request, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run ``fn`` on ingest's own threads (``app.state.ingest_pool``), never the worker threads that
    reads take (and run nicer: ``ledger.reads.read_priority``)."""
    return asyncio.get_running_loop().run_in_executor(request.app.state.ingest_pool, fn, *args)


def require(role: auth.Role) -> Any:
    """Declare the route's role. ``ledger.api.gate`` finds it (``ROLE_ATTR``) and checks the token
    before the app reads the request; the check here repeats it for an app run without the gate. Async,
    so that it never waits for a worker thread behind slow reads."""

    async def dep(request: Request) -> None:
        auth.check(request.app.state.settings, request, role)

    setattr(dep, ROLE_ATTR, role)
    return Depends(dep)
