"""What every request passes before the app reads anything of it (an ASGI middleware).

In order, on the event loop, without a worker thread:

1. the route's role (declared with ``ledger.api.deps.require``); when that role has no token (the
   loopback default), ``Host`` and ``Origin`` must be this machine's (``ledger.api.origin``): 403
   ``not_loopback``;
2. a request with a body must send it as JSON (``application/json`` or ``*/*+json``) or say nothing (an
   ingest body may also be the columnar message, ``engine_hooks.columnar.MEDIA_TYPE``): a ``text/plain``
   or form post gets 415 ``unsupported_media_type``;
3. the token (``ledger.auth``), with failed checks counted and limited per client address
   (``ledger.auth_failures``): 401/403, or 429 ``too_many_failed_tokens``;
4. a read route takes a read slot (``ledger.budgets``) or gets 429 ``read_busy`` with ``Retry-After``;
5. the body's size and deadline while the app reads it (``ledger.api.body_guard``): 413, 408;
6. every part of the answer must be taken by the client within ``send_timeout_s``: a client that stops
   reading (a stalled Parquet export) is abandoned, so its handler ends and its database connection,
   transaction and read slot are released, instead of being held for as long as the client likes.

Every refusal is the API's one error body naming the limit, and is counted in
``chunkledger_request_refusals_total{limit}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter
from fastapi.routing import APIRoute
from starlette.responses import Response
from starlette.routing import Match

from engine_hooks import columnar
from ledger import auth
from ledger.api import errors, origin
from ledger.api.body_guard import guard_body
from ledger.api.deps import ROLE_ATTR
from ledger.auth_failures import FailedTokens
from ledger.budgets import ReadSlots
from ledger.config import Settings
from ledger.intake import media_type
from ledger.metrics import LedgerMetrics

log = logging.getLogger(__name__)

Message = dict[str, Any]
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class SendTimeout(Exception):
    """The client took no part of the answer for ``send_timeout_s``."""


def _role_of(route: APIRoute) -> auth.Role | None:
    stack = list(route.dependant.dependencies)
    while stack:
        dep = stack.pop()
        role = getattr(dep.call, ROLE_ATTR, None)
        if role is not None:
            return role  # type: ignore[no-any-return]
        stack.extend(dep.dependencies)
    return None


def _json_type(content_type: str) -> bool:
    media = media_type(content_type)
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class _Headers:
    def __init__(self, scope: Message) -> None:
        self.raw: dict[str, str] = {}
        for name, value in scope.get("headers", ()):
            self.raw.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.raw.get(name, default)


class _Request:
    """The little of a request ``ledger.auth.check`` reads (its headers)."""

    def __init__(self, headers: _Headers) -> None:
        self.headers = headers


class RequestGate:
    def __init__(
        self, app: Any, settings: Settings, metrics: LedgerMetrics, routers: Sequence[APIRouter]
    ) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics
        self.slots = ReadSlots(settings.read_max_concurrent, settings.read_max_concurrent_per_client)
        self.failed = FailedTokens(settings.auth_failures_per_minute)
        # The app's routes with the role each declares (the routers the app includes, as they are).
        self._routes = [
            (route, _role_of(route))
            for router in routers
            for route in router.routes
            if isinstance(route, APIRoute)
        ]

    def _route_role(self, scope: Message) -> auth.Role | None:
        """The role of the route the request is for (None: no route, or one without a token)."""
        for route, role in self._routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return role
        return None

    def _refusal(self, status: int, limit: str, detail: str, **kw: Any) -> Response:
        """The error answer naming ``limit``, counted in ``chunkledger_request_refusals_total``."""
        self.metrics.request_refusals.labels(limit).inc()
        reason = kw.pop("reason", None)
        return errors.error_response(status, detail, reason=reason, limit=limit, **kw)

    async def __call__(self, scope: Message, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _Headers(scope)
        role = self._route_role(scope)
        client = (scope.get("client") or ("unknown", 0))[0]
        refusal = (
            self._origin_refusal(headers, role)
            or self._content_type_refusal(scope, headers, role)
            or self._token_refusal(headers, role, client)
        )
        slot = refusal is None and role == "read"
        if slot:
            busy = self.slots.acquire(client)
            if busy is not None:
                slot = False
                refusal = self._refusal(
                    429, busy.limit, busy.detail, reason="read_busy", headers={"Retry-After": "1"}
                )
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        try:
            await self._serve(scope, receive, send, ingest=role == "ingest")
        finally:
            if slot:
                self.slots.release(client)

    def _origin_refusal(self, headers: _Headers, role: auth.Role | None) -> Response | None:
        """1. A route whose role has no token answers only this machine."""
        if role is None or auth.required_token(self.settings, role):
            return None
        why = origin.foreign(headers.get("host"), headers.get("origin"))
        if why is None:
            return None
        return self._refusal(
            403,
            "not_loopback",
            f"{why}: this ledger runs without a {role} token, so it answers only requests from "
            "this machine (set the tokens to serve others)",
            reason="not_loopback",
        )

    def _content_type_refusal(
        self, scope: Message, headers: _Headers, role: auth.Role | None
    ) -> Response | None:
        """2. A body is JSON or says nothing of its type; an ingest body may be the columnar message."""
        has_body = scope.get("method") in _BODY_METHODS and (
            headers.get("content-length", "0") != "0" or headers.get("transfer-encoding") is not None
        )
        content_type = headers.get("content-type")
        if not has_body or content_type is None or _json_type(content_type):
            return None
        if role == "ingest" and media_type(content_type) == columnar.MEDIA_TYPE:
            return None
        if role == "ingest":
            return self._refusal(
                415,
                "content_type",
                f"content-type: {content_type!r} is not a body this ledger reads; send application/json or "
                f"{columnar.MEDIA_TYPE} (wire version {columnar.WIRE_VERSION}); nothing stored",
                reason="unsupported_media_type",
                headers={"Accept-Post": f"application/json, {columnar.MEDIA_TYPE}"},
            )
        return self._refusal(
            415,
            "content_type",
            f"content-type: {content_type!r} is not JSON; send the body as application/json",
            reason="unsupported_media_type",
        )

    def _token_refusal(self, headers: _Headers, role: auth.Role | None, client: str) -> Response | None:
        """3. The route's token, with failed checks limited per client address."""
        settings = self.settings
        if role is None or not auth.required_token(settings, role):
            return None
        if headers.get("authorization") is not None:
            wait = self.failed.retry_after(client)
            if wait is not None:
                self.metrics.auth_failures.labels("limited").inc()
                return self._refusal(
                    429,
                    "auth_failures_per_minute",
                    f"auth_failures_per_minute: {settings.auth_failures_per_minute} failed token checks "
                    f"from {client} within a minute; retry in {wait} s",
                    reason="too_many_failed_tokens",
                    headers={"Retry-After": str(wait)},
                )
        try:
            auth.check(settings, _Request(headers), role)  # type: ignore[arg-type]
        except auth.AuthError as exc:
            self.metrics.auth_failures.labels(exc.reason).inc()
            if exc.reason == "unknown_token":
                self.failed.failed(client, exc.reason, role)
            return errors.error_response(
                exc.status_code, str(exc.detail), reason=exc.reason, headers=exc.headers
            )
        return None

    async def _serve(self, scope: Message, receive: Any, send: Any, *, ingest: bool) -> None:
        """5-6. The app, its body guarded, every part of its answer sent within ``send_timeout_s``."""
        settings = self.settings
        abandoned = False
        send_timeout_s = settings.send_timeout_s

        async def timed_send(message: Message) -> None:
            nonlocal abandoned
            if abandoned:
                raise SendTimeout
            try:
                async with asyncio.timeout(send_timeout_s):
                    await send(message)
            except TimeoutError:
                abandoned = True
                raise SendTimeout from None

        try:
            await guard_body(
                self.app,
                scope,
                receive,
                timed_send,
                timeout_s=settings.body_timeout_s,
                max_bytes=None if ingest else settings.max_request_body_bytes,
                limit="max_request_body_bytes",
            )
        except BaseException as exc:
            if not (abandoned and _caused_by_send_timeout(exc)):
                raise
            self.metrics.request_refusals.labels("send_timeout_s").inc()
            log.info(
                "%s %s: the client took no part of the answer for %g s (send_timeout_s); abandoned",
                scope.get("method"),
                scope.get("path"),
                send_timeout_s,
            )


def _caused_by_send_timeout(exc: BaseException) -> bool:
    if isinstance(exc, SendTimeout):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_caused_by_send_timeout(e) for e in exc.exceptions)
    cause = exc.__cause__ or exc.__context__
    return cause is not None and _caused_by_send_timeout(cause)
