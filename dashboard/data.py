"""What the dashboard reads, and only through the ledger's HTTP API (``LedgerClient``, read token).

Every read goes through ``LedgerData``; GETs are cached for ``ttl_s`` seconds per (ledger, token, path,
parameters), so that several charts on one page, and several browser tabs, cost one API call each per
refresh. Endpoints that this ledger does not serve yet (a 404 from the router itself, not a "no such
request") raise ``Unavailable``, which pages turn into a "not available in this ledger" note.

The functions that turn API answers into pandas frames live here too, so pages only lay things out.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ledger.client import DEFAULT_LEDGER_URL, LedgerClient, LedgerError

LAYERS = ("entry_s", "admission_s", "frontend_s", "engine_queue_s", "prefill_s", "decode_s")
LAYER_NAMES = {
    "entry_s": "entry",
    "admission_s": "admission",
    "frontend_s": "engine front end",
    "engine_queue_s": "engine queue",
    "prefill_s": "prefill",
    "decode_s": "decode",
}
TAILS = ("p50", "p90", "p99")
# The latencies a user picks from on the overview and the requests table, with their labels.
LATENCIES = {
    "client_ttft_s": "TTFT at the client",
    "ttft_s": "TTFT (engine)",
    "e2e_s": "end to end",
    "engine_queue_s": "engine queue",
    "frontend_s": "engine front end",
    "delivery_s": "first token delivery",
    "backend_wait_s": "backend wait",
    "prefill_s": "prefill",
    "decode_s": "decode",
    "admission_s": "admission",
    "entry_s": "entry",
    "kv_idle_s": "KV idle",
}
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

    # -- endpoints -------------------------------------------------------------------------------
    def attribution(
        self,
        since: str | None,
        until: str | None = None,
        *,
        group_by: Iterable[str] = (),
        bucket_s: float | None = None,
    ) -> dict[str, Any]:
        return self.get(
            "/v1/attribution", since=since, until=until, group_by=",".join(group_by), bucket_s=bucket_s
        )

    def itl(self, since: str | float | None, until: str | float | None = None) -> dict[str, Any] | None:
        out = self.get("/v1/itl", since=since, until=until)
        return out["itl"][0] if out.get("itl") else None

    def requests(self, **params: Any) -> dict[str, Any]:
        return self.get("/v1/requests", **params)

    def request(self, request_id: str) -> dict[str, Any]:
        return self.get(f"/v1/requests/{request_id}")

    def why(self, request_id: str, top: int = 5) -> dict[str, Any]:
        return self.get(f"/v1/requests/{request_id}/why", top=top)

    def request_itl(self, request_id: str) -> dict[str, Any]:
        return self.get(f"/v1/requests/{request_id}/itl")

    def kv_stalls(self, limit: int = 200) -> dict[str, Any]:
        return self.get("/v1/kv/stalls", limit=limit)

    def sources(self) -> list[dict[str, Any]]:
        return list(self.get("/v1/sources").get("sources", []))

    def advice(self, itl_target_ms: float, **params: Any) -> dict[str, Any]:
        return self.get("/v1/advice/chunk-size", itl_target_ms=itl_target_ms, **params)

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
    if value.kind == "unavailable":
        raise Unavailable(value.message)
    if value.kind == "not_found":
        raise NotFound(value.message)
    if value.kind == "refused":
        raise Refused(value.message)
    raise LedgerError(value.message, value.status)


# -- frames ------------------------------------------------------------------------------------------
def bucket_for(span_s: float, target_buckets: int = 40) -> float:
    """A round bucket width giving at most ``target_buckets`` buckets over ``span_s`` (1 s .. 1 day)."""
    for b in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400):
        if span_s / b <= target_buckets:
            return float(b)
    return 86400.0


def data_span(data: LedgerData, since: str | None, since_s: float | None, now: float) -> tuple[float, float]:
    """(first, last) end of a finished request in the window, at least 10 s apart and ending no earlier
    than now: buckets follow the data, so a young ledger is not drawn as one point."""
    first = data.requests(since=since, live=False, sort="end_ts", order="asc", limit=1)["rows"]
    last = data.requests(since=since, live=False, sort="end_ts", order="desc", limit=1)["rows"]
    if not first or first[0].get("end_ts") is None:
        return (since_s if since_s else now - 3600.0), now
    lo = float(first[0]["end_ts"])
    hi = max(now, float(last[0].get("end_ts") or now)) if last else now
    return min(lo, hi - 10.0), hi


def tails_long(groups: list[dict[str, Any]], metrics: Iterable[str]) -> pd.DataFrame:
    """Bucketed attribution -> one row per (bucket, metric, tail) with the value in milliseconds."""
    rows = []
    for g in groups:
        for m in metrics:
            s = g["layers"].get(m) or {}
            if not s.get("n"):
                continue
            for t in (*TAILS, "max"):
                if s.get(t) is not None:
                    rows.append(
                        {
                            "time": pd.to_datetime(g["bucket_ts"], unit="s", utc=True),
                            "bucket_ts": g["bucket_ts"],
                            "metric": m,
                            "latency": LATENCIES.get(m, m),
                            "tail": t,
                            "ms": s[t] * 1e3,
                            "n": s["n"],
                        }
                    )
    return pd.DataFrame(rows, columns=["time", "bucket_ts", "metric", "latency", "tail", "ms", "n"])


def layers_long(groups: list[dict[str, Any]]) -> pd.DataFrame:
    """Bucketed attribution -> per (bucket, layer): mean and p99 in ms, and the mean's share of e2e."""
    rows = []
    for g in groups:
        means = {m: (g["layers"].get(m) or {}).get("mean") for m in LAYERS}
        total = sum(v for v in means.values() if v)
        for m in LAYERS:
            s = g["layers"].get(m) or {}
            if s.get("mean") is None:
                continue
            rows.append(
                {
                    "time": pd.to_datetime(g["bucket_ts"], unit="s", utc=True),
                    "layer": LAYER_NAMES[m],
                    "order": LAYERS.index(m),
                    "mean_ms": s["mean"] * 1e3,
                    "p50_ms": (s.get("p50") or 0.0) * 1e3,
                    "p99_ms": (s.get("p99") or 0.0) * 1e3,
                    "share": (s["mean"] / total) if total else 0.0,
                }
            )
    cols = ["time", "layer", "order", "mean_ms", "p50_ms", "p99_ms", "share"]
    return pd.DataFrame(rows, columns=cols)


def throughput(groups: list[dict[str, Any]], bucket_s: float) -> pd.DataFrame:
    """Finished requests per second, output tokens per second and preemptions (of the requests that
    finished in it), per bucket; ``time`` .. ``time_end`` is the bucket."""
    rows = [
        {
            "time": pd.to_datetime(g["bucket_ts"], unit="s", utc=True),
            "time_end": pd.to_datetime(g["bucket_ts"] + bucket_s, unit="s", utc=True),
            "bucket_ts": float(g["bucket_ts"]),
            "requests": int(g["requests"]),
            "requests_per_s": g["requests"] / bucket_s,
            "output_tokens_per_s": (g.get("output_tokens") or 0) / bucket_s,
            "preemptions": int(g.get("preemptions") or 0),
        }
        for g in groups
    ]
    cols = [
        "time",
        "time_end",
        "bucket_ts",
        "requests",
        "requests_per_s",
        "output_tokens_per_s",
        "preemptions",
    ]
    return pd.DataFrame(rows, columns=cols)


def bucket_domain(lo: float, hi: float, bucket_s: float) -> tuple[float, float]:
    """The x extent of time-bucketed bars over the data span ``lo``..``hi``: whole buckets."""
    start = math.floor(lo / bucket_s) * bucket_s
    end = max(start + bucket_s, math.ceil(hi / bucket_s) * bucket_s)
    return start, end


def timeline(
    request: dict[str, Any], events: list[dict[str, Any]], why: dict[str, Any] | None
) -> pd.DataFrame:
    """A request's life as Gantt bars: (lane, what, start, end, label), times in seconds since arrival.

    Lanes: "layers" (entry, admission, engine front end, engine queue, prefill, decode as cut by the
    ledger), "client" (from the first token written to the client to the last), "engine"
    (each prefill chunk at its step, each preemption -> resume wait, output token groups), and "sat out"
    (steps it held KV without progress, from the why list), plus point marks for cutoffs.
    """
    t0 = request.get("start_ts") or request.get("arrived_ts") or request.get("queued_ts")
    if t0 is None and events:
        t0 = min(e["ts"] for e in events)
    if t0 is None:
        return pd.DataFrame(columns=["lane", "what", "start_s", "end_s", "label"])
    bars: list[dict[str, Any]] = []

    def bar(lane: str, what: str, a: float | None, b: float | None, label: str = "") -> None:
        if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
            return
        bars.append({"lane": lane, "what": what, "start_s": a - t0, "end_s": max(b, a) - t0, "label": label})

    r = request
    arrival = r.get("arrived_ts") or r.get("engine_arrival_ts") or r.get("queued_ts")
    enq = r.get("admission_enqueued_ts") or r.get("queued_ts")
    fwd = r.get("admitted_ts") or enq
    end = r.get("end_ts") or r.get("last_event_ts")
    bar("layers", "entry", arrival, enq, f"{(r.get('entry_s') or 0) * 1e3:.1f} ms")
    if r.get("admitted_ts"):
        bar("layers", "admission", enq, fwd, f"{(r.get('admission_s') or 0) * 1e3:.1f} ms")
    queued = r.get("queued_ts")
    sched = r.get("first_scheduled_ts") or end
    if queued is not None and fwd is not None and sched is not None:
        queued = min(max(queued, fwd), sched)
        bar("layers", "engine front end", fwd, queued, f"{(r.get('frontend_s') or 0) * 1e3:.1f} ms")
        bar("layers", "engine queue", queued, sched, "until first scheduled")
    else:
        bar("layers", "engine queue", fwd, sched, "until first scheduled")
    bar(
        "layers",
        "prefill",
        r.get("first_scheduled_ts"),
        r.get("first_token_ts") or end,
        "first chunk -> first token",
    )
    bar("layers", "decode", r.get("first_token_ts"), end, f"{r.get('output_tokens') or 0} tokens")
    out_first = r.get("first_token_out_ts")
    if out_first is not None:
        ttft = r.get("client_ttft_s")
        label = f"TTFT at the client {ttft * 1e3:.1f} ms" if ttft is not None else "first token out"
        bar("client", "delivered", out_first, r.get("last_token_out_ts") or out_first, label)
    preempted_at: float | None = None
    for e in events:
        kind = e.get("kind")
        if kind == "chunk":
            dur = 0.0
            bar(
                "engine",
                "chunk",
                e["ts"],
                e["ts"] + dur,
                f"step {e.get('step')}: {e.get('tokens')} tokens at depth {e.get('computed_before')}",
            )
        elif kind == "preempted":
            preempted_at = e["ts"]
        elif kind == "resumed" and preempted_at is not None:
            bar("engine", "preempted", preempted_at, e["ts"], f"waited {e.get('wait_s', 0):.3f} s")
            preempted_at = None
        elif kind == "tokens":
            first = e.get("first_ts") or e["ts"]
            bar("engine", "tokens", first, e["ts"], f"{e.get('count')} tokens (total {e.get('total')})")
        elif kind in ("cutoff_applied", "stream_cut"):
            bar("cutoff", "cutoff", e["ts"], e["ts"], f"{e.get('rule')} ({e.get('action', 'cut')})")
        elif kind == "admission_enqueued":
            pass
    if preempted_at is not None:
        bar("engine", "preempted", preempted_at, end or preempted_at, "still waiting")
    for item in (why or {}).get("items", []):
        if item.get("kind") == "sat_out" and item.get("start_ts") is not None:
            bar(
                "sat out",
                "sat out",
                item["start_ts"],
                item["start_ts"] + item["seconds"],
                item.get("detail", ""),
            )
    return pd.DataFrame(bars, columns=["lane", "what", "start_s", "end_s", "label"])
