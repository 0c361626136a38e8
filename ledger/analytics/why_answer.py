"""``why``'s question and answer: :class:`WhyQuery` (asked by the API and the CLI alike) and the
:class:`Why` record it answers with (the API's schema is generated from it)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from ledger.records import UNSET, Record, UnsetType

TOP_DEFAULT = 5
TOP_MAX = 50


class WhyQuery(msgspec.Struct, kw_only=True, frozen=True):
    """What delayed one request: which request, and how many culprits to name per delay."""

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    top: Annotated[int, msgspec.Meta(ge=1, le=TOP_MAX, description="culprits named per delay")] = TOP_DEFAULT


class Culprit(Record, kw_only=True):
    """A request behind a delay. A request that held the engine while this one waited in its queue
    (``engine_queue``, ``preempted``) also has its share of those steps' time; one whose prefill chunks
    filled steps (``sat_out``, ``shared_prefill``...) has its chunks only."""

    request_id: str
    prefill_tokens: Annotated[int, msgspec.Meta(description="its prefill tokens in the item's steps")]
    chunks: Annotated[int, msgspec.Meta(description="its prefill chunks in the item's steps")]
    max_depth: Annotated[int, msgspec.Meta(description="deepest token of those chunks into its prompt")]
    prompt_tokens: Annotated[int | None, msgspec.Meta(description="its whole prompt")]
    request_chunks: Annotated[int | None, msgspec.Meta(description="all its prefill chunks")]
    share_s: (
        Annotated[float, msgspec.Meta(description="its share of the steps' time (by tokens)")] | UnsetType
    ) = UNSET
    steps: Annotated[int, msgspec.Meta(description="the steps it took part in")] | UnsetType = UNSET
    decode_steps: Annotated[int, msgspec.Meta(description="of those, steps it decoded in")] | UnsetType = (
        UNSET
    )


WhyKind = Literal[
    "admission_queue",
    "frontend",
    "engine_queue",
    "preempted",
    "sat_out",
    "shared_prefill",
    "shared_prefill_steps",
]


class WhyItem(Record, kw_only=True):
    """One delay: how long, since when, in words, and the requests behind it (biggest first)."""

    kind: WhyKind
    seconds: float | None
    start_ts: float | None
    detail: str
    steps: Annotated[list[int], msgspec.Meta(description="the engine steps of the delay")] | UnsetType = UNSET
    culprits: list[Culprit]


class WhyLayers(Record, kw_only=True):
    """The request's layers before and through the engine (seconds; null where not measured)."""

    entry_s: float | None
    admission_s: float | None
    frontend_s: float | None
    engine_queue_s: float | None
    prefill_s: float | None
    decode_s: float | None


class Why(Record, kw_only=True):
    """``GET /v1/requests/{request_id}/why``: what delayed the request, biggest first."""

    request_id: str
    e2e_s: float | None
    ttft_s: float | None
    client_ttft_s: float | None
    layers: WhyLayers
    items: Annotated[list[WhyItem], msgspec.Meta(description="biggest first")]
