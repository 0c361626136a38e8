"""The one HTTP client of the ledger's API: the CLI's commands and the dashboard use it (so can notebooks).

While the service runs it owns the DuckDB file, so tools read through the API rather than the file.
Errors come back as :class:`LedgerError`: ``status_code`` None when the ledger could not be reached,
else the HTTP status with the ledger's ``reason`` (a short machine word, when it gives one), ``detail``
(for people; a list of validation errors is flattened to ``field: message; ...``) and ``errors`` (the
list, where the ledger sent one: FastAPI's validation errors, a refused batch's per-event errors).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from ledger.defaults import DEFAULT_LEDGER_URL, LEDGER_URL_ENV


class LedgerError(RuntimeError):
    """The ledger answered with an error (its message says why) or could not be reached."""

    def __init__(
        self,
        message: str,
        status_code: int | None = None,
        *,
        reason: str | None = None,
        detail: str | None = None,
        body: Any = None,
        errors: list[Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.reason = reason
        self.detail = message if detail is None else detail
        self.body = body  # the decoded error body, when it was JSON
        self.errors = errors  # the body's list of errors, when it has one

    @property
    def unreachable(self) -> bool:
        return self.status_code is None

    @property
    def label(self) -> str:
        """``"422"`` or ``"400 not_read_only"``: the status and the ledger's reason."""
        return f"{self.status_code} {self.reason}" if self.reason else str(self.status_code)


def _flat(e: Any) -> str:
    if not isinstance(e, dict):
        return str(e)
    if "loc" not in e and "field" in e:  # a refused batch's error: {index, field, reason}
        return f"{e['field']}: {e.get('reason')}"
    return f"{'.'.join(str(p) for p in e.get('loc', [])[1:])}: {e.get('msg')}"


def flatten_errors(errors: list[Any]) -> str:
    """Errors as ``field: message; ...``: FastAPI's (the location less its ``query``/``body``) or a
    refused batch's."""
    return "; ".join(_flat(e) for e in errors)


def error_from(response: httpx.Response) -> LedgerError:
    """The :class:`LedgerError` for an error answer (its body must have been read)."""
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    reason = body.get("reason") if isinstance(body, dict) else None
    errors = body.get("errors") if isinstance(body, dict) else None
    if not isinstance(errors, list):
        errors = None
    detail: Any = body.get("detail", errors or body) if isinstance(body, dict) else body
    if detail is None:
        detail = response.text.strip() or response.reason_phrase
    if isinstance(detail, list):
        errors = errors if errors is not None else detail
        detail = flatten_errors(detail)
    detail = str(detail)
    return LedgerError(
        f"{response.status_code}: {detail}",
        response.status_code,
        reason=reason if isinstance(reason, str) else None,
        detail=detail,
        body=body,
        errors=errors,
    )


class LedgerClient:
    """``url``: else CHUNKLEDGER_LEDGER_URL, CHUNKLEDGER_URL, the default; ``token``: else the variable
    ``token_env`` (the read token by default; the policy commands pass the admin token's)."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        token_env: str = "CHUNKLEDGER_READ_TOKEN",
        timeout_s: float = 30.0,
    ) -> None:
        env_url = next((os.environ[v] for v in LEDGER_URL_ENV if os.environ.get(v)), None)
        self.url = (url or env_url or DEFAULT_LEDGER_URL).rstrip("/")
        token = token if token is not None else os.environ.get(token_env, "")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> LedgerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _unreachable(self, exc: httpx.HTTPError) -> LedgerError:
        return LedgerError(f"cannot reach the ledger at {self.url}: {exc}")

    def response(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None
    ) -> httpx.Response:
        """One call; the answer when its status is below 400, else :class:`LedgerError`."""
        if params is not None:
            params = {k: v for k, v in params.items() if v is not None}
        try:
            r = self._http.request(method, path, params=params, json=json)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
        if r.status_code >= 400:
            raise error_from(r)
        return r

    def request(self, method: str, path: str, **kw: Any) -> Any:
        """One call; its JSON answer."""
        return self.response(method, path, **kw).json()

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, json=body)

    @contextmanager
    def stream(self, path: str, **params: Any) -> Iterator[httpx.Response]:
        """A GET whose body is read as it arrives (``iter_bytes``); :class:`LedgerError` on an error
        status, or when the connection fails before or while the body streams."""
        try:
            with self._http.stream(
                "GET", path, params={k: v for k, v in params.items() if v is not None}
            ) as r:
                if r.status_code >= 400:
                    r.read()
                    raise error_from(r)
                yield r
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from None
