"""A small HTTP client for the ledger's read API, used by the CLI (and usable from notebooks).

While the service runs it owns the DuckDB file, so tools read through the API rather than the file.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from ledger.defaults import DEFAULT_LEDGER_URL


class LedgerError(RuntimeError):
    """The ledger answered with an error (its message says why) or could not be reached."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class LedgerClient:
    def __init__(self, url: str | None = None, token: str | None = None, *, timeout_s: float = 30.0) -> None:
        # CHUNKLEDGER_URL is what the exporters read; the same ledger serves both.
        env_url = os.environ.get("CHUNKLEDGER_LEDGER_URL") or os.environ.get("CHUNKLEDGER_URL")
        self.url = (url or env_url or DEFAULT_LEDGER_URL).rstrip("/")
        token = token if token is not None else os.environ.get("CHUNKLEDGER_READ_TOKEN", "")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> LedgerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kw: Any) -> Any:
        if "params" in kw:
            kw["params"] = {k: v for k, v in kw["params"].items() if v is not None}
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise LedgerError(f"cannot reach the ledger at {self.url}: {exc}") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise LedgerError(f"{r.status_code}: {detail}", r.status_code)
        return r.json()

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, json=body)
