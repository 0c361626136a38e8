"""The analytics answers as records (:mod:`ledger.records`): tails, attribution, ITL, KV stalls. No
SQL here, so the dashboard can decode the API's JSON into them; the request rows, whose fields are the
``requests`` view's columns, are :mod:`ledger.rows`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from ledger.records import UNSET, Record, UnsetType

# The latencies summarised per request, in the order a reader follows a request through the system.
METRICS = (
    "entry_s",
    "admission_s",
    "backend_wait_s",
    "frontend_s",
    "engine_queue_s",
    "prefill_s",
    "decode_s",
    "ttft_s",
    "client_ttft_s",
    "delivery_s",
    "e2e_s",
    "kv_idle_s",
)


class Tails(Record, kw_only=True):
    """Count and tails (seconds; null when there is nothing to summarise)."""

    n: int
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None
    mean: Annotated[float | None, msgspec.Meta(description="only ever shown next to the tails")]


class ModelTails(Tails, kw_only=True):
    """Decode inter-token latency tails; ``model`` with by_model / group_by=model."""

    model: str | UnsetType | None = UNSET


# One field per latency of METRICS, in that order: the layers of an attribution group.
Layers: Any = msgspec.defstruct(
    "Layers", [(m, Tails) for m in METRICS], bases=(Record,), kw_only=True, module=__name__
)
Layers.__doc__ = "Every layer's tails in the group: " + ", ".join(METRICS)


class AttributionGroup(Record, kw_only=True):
    """One group (and time bucket): the group_by columns asked for, the counts and every layer's tails."""

    model: str | UnsetType | None = UNSET
    engine_source_id: str | UnsetType | None = UNSET
    gateway_source_id: str | UnsetType | None = UNSET
    finish_reason: str | UnsetType | None = UNSET
    bucket_ts: Annotated[float, msgspec.Meta(description="bucket start, with bucket_s")] | UnsetType = UNSET
    requests: Annotated[int, msgspec.Meta(description="finished requests in the group")]
    output_tokens: int
    preemptions: int
    layers: Layers


class Attribution(Record, kw_only=True):
    """``GET /v1/attribution``: per-layer tails of the finished requests, grouped, with decode ITL."""

    since: float | None
    until: float | None
    group_by: list[str]
    groups: list[AttributionGroup]
    itl: Annotated[list[ModelTails], msgspec.Meta(description="decode inter-token latency of the window")]


class Itl(Record, kw_only=True):
    """``GET /v1/itl``: decode inter-token latency tails over the window."""

    since: float | None
    until: float | None
    itl: list[ModelTails]


class RequestItl(Tails, kw_only=True):
    """``GET /v1/requests/{request_id}/itl``: one request's inter-token gaps and their tails."""

    gaps: Annotated[list[float], msgspec.Meta(description="seconds between its tokens, in order")]


class KvStall(Record, kw_only=True):
    """A live request and how long it has gone without progress."""

    request_id: str
    model: str | None
    engine_source_id: str | None
    state: Annotated[Literal["running", "waiting"], msgspec.Meta(description="running holds KV")]
    stall_s: Annotated[float, msgspec.Meta(description="seconds since its last progress")]
    kv_idle_s: float | None
    kv_idle_block_s: float | None
    kv_blocks_max: int | None
    preemptions: int | None
    output_tokens: int | None
    prompt_tokens: int | None
    queued_ts: float | None


class KvStalls(Record, kw_only=True):
    """``GET /v1/kv/stalls``: live requests ranked by seconds without progress."""

    now: float
    requests: list[KvStall]
