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


RANK_BY = ("kv_usage", "waiting", "step_s")


class EngineNow(Record, kw_only=True):
    """One engine as its newest bucket of the window saw it, and where it ranks (1: the worst)."""

    source_id: str
    model: str | None
    rank: Annotated[int, msgspec.Meta(description="1 = the worst engine by rank_by")]
    shown: Annotated[bool, msgspec.Meta(description="drawn on its own (top N, or asked for by source_id)")]
    bucket_ts: Annotated[float, msgspec.Meta(description="start of its newest bucket in the window")]
    last_step_ts: float
    kv_usage: Annotated[float, msgspec.Meta(description="share of its KV cache in use, max in that bucket")]
    waiting: Annotated[int, msgspec.Meta(description="requests waiting, max in that bucket")]
    running: Annotated[int, msgspec.Meta(description="requests running, max in that bucket")]
    step_s: Annotated[float, msgspec.Meta(description="mean step duration in that bucket (s)")]


class EnginePoint(Record, kw_only=True):
    """One time bucket of one series: a model's engines (``kind`` model), one engine shown on its own
    (engine), or a model's engines not shown on their own (rest)."""

    bucket_ts: float
    series: Annotated[str, msgspec.Meta(description="the model (model, rest) or the source id (engine)")]
    kind: Literal["model", "engine", "rest"]
    model: str | None
    engines: Annotated[int, msgspec.Meta(description="engines with steps in the bucket")]
    steps: int
    kv_usage_max: float
    kv_usage_mean: Annotated[float, msgspec.Meta(description="over the series' steps")]
    waiting_max: int
    waiting_mean: Annotated[float, msgspec.Meta(description="over its engines of each one's max waiting")]
    running_max: int
    step_s_mean: float
    step_s_max: float


class EngineLoad(Record, kw_only=True):
    """``GET /v1/engines``: the fleet over time by model, the engines that are worst right now on their
    own (the rest of each model as one series), and every engine ranked worst first."""

    since: float | None
    until: float | None
    bucket_s: float
    rank_by: Literal["kv_usage", "waiting", "step_s"]
    top: int
    engines: list[EngineNow]
    points: list[EnginePoint]
