"""The API's one error body, ``{"reason": ..., "detail": ..., "errors": [...]}``, on every route.

* ``reason``: a short machine word. A route that has its own gives it (``not_read_only``,
  ``too_little_data``, ``missing_token``, ...); otherwise it comes from the status (:data:`REASONS`).
* ``detail``: one readable string naming the field and what is wrong with it.
* ``errors``: only where there is a list: FastAPI's request validation errors (422 ``invalid``, the
  detail is then ``field: message; field: message``) and the ingest's per-event errors.

:func:`install` makes FastAPI's and Starlette's exceptions answer with it: an ``HTTPException`` (any
with a ``reason`` attribute gives its own, like :class:`ApiError` and ``ledger.auth``'s), a request
validation error, and an unexpected exception (500, logged as before).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ledger.api.models import ErrorBody
from ledger.refusal import Refusal

log = logging.getLogger(__name__)

REASONS: dict[int, str] = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    408: "timeout",
    409: "conflict",
    411: "length_required",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid",
    429: "too_many_requests",
    500: "internal",
    501: "not_implemented",
    502: "bad_gateway",
    503: "unavailable",
    504: "gateway_timeout",
}

# Where FastAPI says a value came from: dropped from the field names in ``detail``.
_PLACES = frozenset({"query", "body", "path", "header", "cookie"})


def reason_for(status_code: int) -> str:
    return REASONS.get(status_code) or ("bad_request" if status_code < 500 else "internal")


class ApiError(HTTPException):
    """An ``HTTPException`` with its own ``reason`` (else the status's)."""

    def __init__(
        self,
        status_code: int,
        detail: str,
        *,
        reason: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status_code, detail=detail, headers=dict(headers) if headers else None)
        self.reason = reason or reason_for(status_code)


def error_body(
    status_code: int,
    detail: str,
    *,
    reason: str | None = None,
    errors: Sequence[Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {"reason": reason or reason_for(status_code), "detail": detail}
    if errors is not None:
        body["errors"] = list(errors)
    body.update(extra)
    return body


def error_response(
    status_code: int,
    detail: str,
    *,
    reason: str | None = None,
    errors: Sequence[Any] | None = None,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """The error body as a response (``extra``: more fields a route documents, e.g. advice's window)."""
    return JSONResponse(
        error_body(status_code, detail, reason=reason, errors=errors, **extra),
        status_code=status_code,
        headers=dict(headers) if headers else None,
    )


def _field(error: Mapping[str, Any]) -> str:
    if error.get("type") == "json_invalid":
        return "body"  # its location is ("body", <character offset>)
    loc = [str(p) for p in error.get("loc") or ()]
    if len(loc) > 1 and loc[0] in _PLACES:
        loc = loc[1:]
    return ".".join(loc) or "request"


def flatten(errors: Sequence[Any]) -> str:
    """FastAPI's validation errors as ``field: message; field: message``."""
    return (
        "; ".join(f"{_field(e)}: {e.get('msg', '')}" if isinstance(e, Mapping) else str(e) for e in errors)
        or "the request is invalid"
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    headers = getattr(exc, "headers", None)
    if exc.status_code < 400:  # 204, 304: no body
        return Response(status_code=exc.status_code, headers=headers)
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    reason = getattr(exc, "reason", None)
    return error_response(
        exc.status_code, detail, reason=reason if isinstance(reason, str) else None, headers=headers
    )


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = jsonable_encoder(exc.errors())
    return error_response(422, flatten(errors), reason="invalid", errors=errors)


async def _unexpected(request: Request, exc: Exception) -> Response:
    # Starlette's ServerErrorMiddleware calls this, then re-raises: the traceback is logged as before.
    return error_response(500, "internal error: the ledger's log has the details", reason="internal")


async def _refusal(request: Request, exc: Exception) -> Response:
    # a computed answer the ledger declines (advice, what-if): its status, reason and figures
    assert isinstance(exc, Refusal)
    return error_response(exc.status, str(exc), reason=exc.reason, **exc.details)


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Refusal, _refusal)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)


def responses(
    *statuses: int, models: Mapping[int, type[ErrorBody]] | None = None
) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` naming the error body for each status (``models``: a more specific one for
    a status, e.g. ``{422: BatchRejected}``)."""
    models = models or {}
    return {
        code: {"model": models.get(code, ErrorBody), "description": _DESCRIPTIONS.get(code, "error")}
        for code in statuses
    }


AUTH = (401, 403)  # every route behind a token


_DESCRIPTIONS = {
    400: "bad request (reason says which)",
    401: "missing or unknown bearer token (missing_token, unknown_token)",
    403: "a valid token of a role this endpoint does not accept (forbidden)",
    404: "not found",
    408: "timed out (timeout; body_timeout: the request body stopped arriving)",
    409: "refused in this state (reason says why)",
    413: "body too large (too_large)",
    415: "a Content-Type the ledger does not read (unsupported_media_type; Accept-Post lists those it does)",
    422: "invalid: detail names each field; errors lists FastAPI's validation errors",
    429: "over a limit (rate_limited: detail and limit name it); retry after Retry-After seconds",
    503: "unavailable: retry later",
}
