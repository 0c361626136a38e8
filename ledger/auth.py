"""Bearer-token roles: ingest (sources), read (dashboards, tools), admin (everything), and metrics
(``GET /metrics``: the metrics token when one is set, else the read token).

Each route declares its role with ``ledger.api.deps.require``; ``ledger.api.gate`` checks it before the
app reads anything of the request (its body included).
"""

from __future__ import annotations

import hmac
from typing import Literal

from fastapi import HTTPException, Request, status

from ledger.config import Settings

Role = Literal["ingest", "read", "admin", "metrics"]


class AuthError(HTTPException):
    """A refused token: 401 (``missing_token``, ``unknown_token``) or 403 (``forbidden``). The API's
    error handler sends ``reason`` with the detail (``ledger.api.errors``)."""

    def __init__(self, status_code: int, detail: str, reason: str) -> None:
        headers = {"WWW-Authenticate": "Bearer"} if status_code == status.HTTP_401_UNAUTHORIZED else None
        super().__init__(status_code, detail=detail, headers=headers)
        self.reason = reason


def _tokens_for(settings: Settings, role: Role) -> list[str]:
    if role == "ingest":
        return [settings.ingest_token, settings.admin_token]
    if role == "read":
        return [settings.read_token, settings.admin_token]
    if role == "metrics":
        return [settings.metrics_token or settings.read_token, settings.admin_token]
    return [settings.admin_token]


def required_token(settings: Settings, role: Role) -> str:
    """The role's own token; empty: the role is open (only allowed on a loopback bind)."""
    if role == "metrics":
        return settings.metrics_token or settings.read_token
    return {"ingest": settings.ingest_token, "read": settings.read_token, "admin": settings.admin_token}[role]


def check(settings: Settings, request: Request, role: Role) -> None:
    """Raise 401 (no or unknown token) or 403 (a valid token of another role)."""
    if not required_token(settings, role):
        return  # open role: only allowed on a loopback bind (Settings.check_safe_to_bind)
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthError(
            status.HTTP_401_UNAUTHORIZED,
            f"missing bearer token: this endpoint needs the {role} token",
            "missing_token",
        )
    if any(t and hmac.compare_digest(token.encode(), t.encode()) for t in _tokens_for(settings, role)):
        return
    all_tokens = [settings.ingest_token, settings.read_token, settings.admin_token]
    if role != "metrics" and any(t and hmac.compare_digest(token.encode(), t.encode()) for t in all_tokens):
        raise AuthError(status.HTTP_403_FORBIDDEN, f"this token may not use {role} endpoints", "forbidden")
    raise AuthError(status.HTTP_401_UNAUTHORIZED, "unknown bearer token", "unknown_token")
