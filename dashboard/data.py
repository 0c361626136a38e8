"""What the dashboard reads, and only through the ledger's HTTP API (``LedgerClient``, read token).

Every read goes through ``LedgerData``; GETs are cached for ``ttl_s`` seconds per (ledger, token, path,
parameters), so that several charts on one page, and several browser tabs, cost one API call each per
refresh. Endpoints that this ledger does not serve yet (a 404 from the router itself, not a "no such
request") raise ``Unavailable``, which pages turn into a "not available in this ledger" note.

The analytics, why, advice and what-if answers are decoded here, once, into the records the ledger
built them as (``ledger.analytics.answers``, ``ledger.advice.answer``, ...); an answer that is not
that record (an older ledger's) is ``Unavailable`` too.

The functions that turn its answers into pandas frames are in :mod:`dashboard.frames`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import msgspec
import pandas as pd

from ledger.advice.answer import ChunkSizeAdvice
from ledger.analytics.answers import Attribution, EngineLoad, Itl, KvStalls, ModelTails, RequestItl
from ledger.analytics.why_answer import TOP_DEFAULT, Why
from ledger.client import DEFAULT_LEDGER_URL, LedgerClient, LedgerError
from ledger.records import Record
from ledger.whatif.answer import WhatIf

R = TypeVar("R", bound=Record)

WINDOWS = {"15 min": "15m", "1 hour": "1h", "6 hours": "6h", "24 hours": "24h", "7 days": "7d", "all": ""}


class Unavailable(RuntimeError):
    """The ledger does not serve this endpoint (an older or partial ledger)."""


class NotFound(LookupError):
    """The endpoint exists but the thing asked for does not (e.g. an unknown request id)."""


class Refused(RuntimeError):
    """The ledger understood the question and declined it (400/409/422); ``detail`` says why."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _route_missing(status: int | None, detail: Any) -> bool:
    """FastAPI answers an unknown route with 404 {"detail": "Not Found"} and a wrong method with 405."""
    return status == 405 or (status == 404 and detail == "Not Found")


@dataclass(frozen=True)
class Settings:
    """Where the dashboard reads from; from the environment set by ``chunkledger dashboard``."""

    url: str
    token: str
    ttl_s: float
    refresh_s: float

    @classmethod
    def from_env(cls) -> Settings:
        return cls(
            url=(os.environ.get("CHUNKLEDGER_LEDGER_URL") or DEFAULT_LEDGER_URL).rstrip("/"),
            token=os.environ.get("CHUNKLEDGER_READ_TOKEN", ""),
            ttl_s=float(os.environ.get("CHUNKLEDGER_DASHBOARD_TTL_S", "2")),
            refresh_s=float(os.environ.get("CHUNKLEDGER_DASHBOARD_REFRESH_S", "10")),
        )


class _Cache:
    """A small TTL cache of API answers, shared by every session of the Streamlit process."""

    def __init__(self, max_entries: int = 512) -> None:
        self._lock = threading.Lock()
        self._entries: dict[tuple[Any, ...], tuple[float, Any]] = {}
        self._max = max_entries

    def get(self, key: tuple[Any, ...], ttl_s: float) -> tuple[bool, Any]:
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and time.monotonic() - hit[0] < ttl_s:
            return True, hit[1]
        return False, None

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        with self._lock:
            if len(self._entries) >= self._max:
                oldest = min(self._entries, key=lambda k: self._entries[k][0])
                del self._entries[oldest]
            self._entries[key] = (time.monotonic(), value)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


CACHE = _Cache()
_CLIENTS: dict[tuple[str, str], LedgerClient] = {}
_CLIENTS_LOCK = threading.Lock()


def _client(url: str, token: str) -> LedgerClient:
    with _CLIENTS_LOCK:
        c = _CLIENTS.get((url, token))
        if c is None:
            c = _CLIENTS[(url, token)] = LedgerClient(url, token, timeout_s=20.0)
        return c


WHATIF_TIMEOUT_S = 180.0


class LedgerData:
    """The ledger's read API as the dashboard uses it (cached GETs, typed errors)."""

    def __init__(self, url: str, token: str = "", *, ttl_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.ttl_s = ttl_s

    @classmethod
    def from_settings(cls, s: Settings) -> LedgerData:
        return cls(s.url, s.token, ttl_s=s.ttl_s)

    # -- transport -------------------------------------------------------------------------------
    def _call(self, method: str, path: str, params: dict[str, Any] | None, body: Any = None) -> Any:
        params = {k: v for k, v in (params or {}).items() if v is not None and v != ""}
        key = (self.url, self.token, method, path, json.dumps(params, sort_keys=True), json.dumps(body))
        cacheable = method == "GET" or path == "/v1/sql"
        value: Any
        if cacheable:
            hit, value = CACHE.get(key, self.ttl_s)
            if hit:
                return _raise_cached(value)
        client = _client(self.url, self.token)
        try:
            if method == "GET":
                value = client.get(path, **params)
            else:
                value = client.request(method, path, params=params, json=body)
        except LedgerError as exc:
            value = _error_value(exc)
        if cacheable and not (isinstance(value, _Error) and value.kind == "down"):
            CACHE.put(key, value)
        return _raise_cached(value)

    def get(self, path: str, **params: Any) -> Any:
        return self._call("GET", path, params)

    def read(self, record: type[R], path: str, **params: Any) -> R:
        """``GET path`` decoded into ``record``; ``Unavailable`` when the answer is not one."""
        return _decoded(record, path, self.get(path, **params))

    # -- endpoints -------------------------------------------------------------------------------
    def attribution(
        self,
        since: str | None,
        until: str | None = None,
        *,
        group_by: Iterable[str] = (),
        bucket_s: float | None = None,
    ) -> Attribution:
        return self.read(
            Attribution,
            "/v1/attribution",
            since=since,
            until=until,
            group_by=",".join(group_by),
            bucket_s=bucket_s,
        )

    def itl(self, since: str | float | None, until: str | float | None = None) -> ModelTails | None:
        out = self.read(Itl, "/v1/itl", since=since, until=until)
        return out.itl[0] if out.itl else None

    # The request rows, a request's events, the sources and the cutoffs stay JSON objects: their records
    # (ledger.rows) are made from the storage tables (ledger.schema), which the dashboard does not import.
    def requests(self, **params: Any) -> dict[str, Any]:
        return self.get("/v1/requests", **params)

    def request(self, request_id: str) -> dict[str, Any]:
        return self.get(f"/v1/requests/{request_id}")

    def why(self, request_id: str, top: int = TOP_DEFAULT) -> Why:
        return self.read(Why, f"/v1/requests/{request_id}/why", top=top)

    def request_itl(self, request_id: str) -> RequestItl:
        return self.read(RequestItl, f"/v1/requests/{request_id}/itl")

    def kv_stalls(self, limit: int = 200) -> KvStalls:
        return self.read(KvStalls, "/v1/kv/stalls", limit=limit)

    def engines(
        self,
        since: str | None,
        *,
        bucket_s: float,
        top: int,
        rank_by: str = "kv_usage",
        source_ids: Iterable[str] = (),
    ) -> EngineLoad:
        """The engines by model and the worst right now (``GET /v1/engines``)."""
        return self.read(
            EngineLoad,
            "/v1/engines",
            since=since,
            bucket_s=bucket_s,
            top=top,
            rank_by=rank_by,
            source_id=sorted(source_ids) or None,
        )

    def sources(self) -> list[dict[str, Any]]:
        return list(self.get("/v1/sources").get("sources", []))

    def advice(self, itl_target_ms: float, **params: Any) -> ChunkSizeAdvice:
        """The advice, decoded into the record the ledger built it as."""
        return self.read(ChunkSizeAdvice, "/v1/advice/chunk-size", itl_target_ms=itl_target_ms, **params)

    def whatif(self, **params: Any) -> WhatIf:
        """``GET /v1/whatif`` (not cached: every call is a replay the user asked for)."""
        asked = {k: v for k, v in params.items() if v not in (None, "", [])}
        try:  # a replay can take tens of seconds: a client with a longer timeout than the reads'
            with LedgerClient(self.url, self.token, timeout_s=WHATIF_TIMEOUT_S) as client:
                answer = client.get("/v1/whatif", **asked)
        except LedgerError as exc:
            _raise(_error_value(exc))
        return _decoded(WhatIf, "/v1/whatif", answer)

    def cutoffs(self, since_s: float | None = None, limit: int = 5000) -> pd.DataFrame:
        """Cutoff decisions (``GET /v1/cutoffs``, newest first) decided at or after ``since_s``."""
        df = pd.DataFrame(self.get("/v1/cutoffs", limit=limit).get("cutoffs", []))
        if df.empty:
            return df
        df["decided_ts"] = df["decided_ts"].astype(float)
        if since_s:
            df = df[df["decided_ts"] >= since_s]
        return df.reset_index(drop=True)

    def sql(self, query: str, max_rows: int | None = None) -> pd.DataFrame:
        """A read-only query through ``POST /v1/sql``: a frame with the answer's columns (attrs: truncated,
        elapsed_s)."""
        body: dict[str, Any] = {"sql": query}
        if max_rows is not None:
            body["max_rows"] = max_rows
        out = self._call("POST", "/v1/sql", None, body)
        df = pd.DataFrame(out.get("rows", []), columns=out.get("columns", []))
        df.attrs["truncated"] = bool(out.get("truncated"))
        df.attrs["elapsed_s"] = out.get("elapsed_s")
        df.attrs["types"] = out.get("types", [])
        return df

    def available(self, path: str, **params: Any) -> bool:
        try:
            self.get(path, **params)
        except Unavailable:
            return False
        except (NotFound, Refused, LedgerError):
            return True
        return True


def _decoded(record: type[R], path: str, answer: Any) -> R:
    """The answer of ``path`` as ``record``; a ledger that answers in another shape (an older one) does
    not serve what the dashboard reads there: ``Unavailable``."""
    try:
        return msgspec.convert(answer, record)
    except msgspec.ValidationError as exc:
        raise Unavailable(
            f"{path} answers something other than the {record.__name__} record ({exc})"
        ) from None


@dataclass(frozen=True)
class _Error:
    kind: str  # unavailable | not_found | refused | down | error
    message: str
    status: int | None


def _error_value(exc: LedgerError) -> _Error:
    status = exc.status_code
    text = str(exc)
    detail: Any = text.split(": ", 1)[1] if ": " in text and status is not None else text
    if status is None:
        return _Error("down", text, None)
    if _route_missing(status, detail):
        return _Error("unavailable", text, status)
    if status == 404:
        return _Error("not_found", str(detail), status)
    if status in (400, 409, 422):
        return _Error("refused", str(detail), status)
    return _Error("error", text, status)


def _raise_cached(value: Any) -> Any:
    if not isinstance(value, _Error):
        return value
    _raise(value)


def _raise(value: _Error) -> NoReturn:
    if value.kind == "unavailable":
        raise Unavailable(value.message)
    if value.kind == "not_found":
        raise NotFound(value.message)
    if value.kind == "refused":
        raise Refused(value.message)
    raise LedgerError(value.message, value.status)
