"""FastAPI dependencies as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from ledger import auth
from ledger.config import Settings
from ledger.ingest import IngestWriter
from ledger.store import Store


def get_settings(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


def get_store(request: Request) -> Store:
    return request.app.state.store  # type: ignore[no-any-return]


def get_writer(request: Request) -> IngestWriter:
    return request.app.state.writer  # type: ignore[no-any-return]


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
WriterDep = Annotated[IngestWriter, Depends(get_writer)]


def require(role: auth.Role):  # type: ignore[no-untyped-def]
    def dep(request: Request, settings: SettingsDep) -> None:
        auth.check(settings, request, role)

    return Depends(dep)
