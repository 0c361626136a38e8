"""The wire contract between event sources (engines, gateways) and the ledger.

This module is the one place the contract lives; both sides import it. It depends on msgspec only, so
it can be imported inside an inference engine without pulling in the ledger's dependencies.

Rules that hold for every event:

* ``seq`` numbers the events of one source, strictly increasing in emit order; gaps are allowed
  (a restarted source starts higher), lost events are reported by ``dropped`` markers.
  ``(source.id, seq)`` is the identity of an event: a batch that is sent twice is stored once.
* ``ts`` is the source's wall clock in unix seconds (float). Intervals inside one source are measured
  with the source's monotonic clock and sent as durations (fields ending in ``_s``), so the ledger never
  has to subtract wall-clock timestamps to measure a wait. A timestamp more than the ledger's
  ``max_clock_ahead_s`` (300 s) ahead of its receive time is stored as the receive time.
* ``request_id`` is the external request id (the gateway's, or without a gateway the id the client
  knows: its ``X-Request-Id``, else the response id; see ``engine_hooks.vllm.scheduler``). It is
  present on every event but ``step`` and ``dropped``.
* Unknown fields are ignored by the decoder, so a newer source can talk to an older ledger. Adding an
  optional field is a compatible change; anything else bumps ``SCHEMA_VERSION``.
* Prompt text and output text never travel. Output token ids may travel (for the loop detector) and
  are not persisted by the ledger unless it is configured to.
* A producer (one exporter) sends a key of its own in the ``PRODUCER_HEADER`` header with every batch
  and command poll; the ledger binds the source id to the first key it sees and fences other keys
  while the source is live (409 ``fenced``: retry later), so no other holder of the ingest token can
  write as the source or read its commands. The exporter keeps its key in its spool folder, so a
  restarted producer is the same producer. A source sent without a key stays unbound, as before.
* An event stored under ``(source.id, seq)`` is never replaced: a batch that sends another event
  under a stored seq is answered 409 ``conflicting_replay`` naming the seqs (the batch's other events
  are stored).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

import msgspec

# 2: ``step`` events may carry the output tokens of the requests they ran (``token_counts``,
# ``token_totals``, ``token_ids``) in place of per-request ``tokens`` events. A ledger that knows only
# version 1 would drop those tokens without a word, so it refuses such batches (upgrade the ledger
# first). Version 1 batches are read as before.
SCHEMA_VERSION = 2

# Ranges. Every integer fits the ledger's 64-bit columns; the counts that the ledger sums per request
# (tokens, blocks) are at most 2^31 - 1 each, so a sum overflows only after 2^32 events of one request
# (and the stores saturate at 2^63 - 1 even then). Durations are at most 10^9 s (32 years),
# timestamps at most 10^10 (the year 2286): no float that the ledger adds can become infinite.
INT64_MAX = 2**63 - 1
COUNT_MAX = 2**31 - 1
DURATION_MAX_S = 1e9
TS_MAX = 1e10

Seq = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # sequence and step numbers
Int64 = Annotated[int, msgspec.Meta(ge=-INT64_MAX - 1, le=INT64_MAX)]
NonNegInt64 = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=COUNT_MAX)]  # counts of tokens, blocks, requests
NonNegFloat = Annotated[float, msgspec.Meta(ge=0, le=DURATION_MAX_S)]  # durations in seconds
Timestamp = Annotated[
    float, msgspec.Meta(gt=0, le=TS_MAX, description="unix seconds, the source's wall clock")
]
StatusCode = Annotated[int, msgspec.Meta(ge=0, le=999)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Ratio = Annotated[float, msgspec.Meta(ge=0, le=1)]
# W3C Trace Context ids (``engine_hooks.tracecontext``): lowercase hex, never all zeros.
TraceId = Annotated[str, msgspec.Meta(pattern="^(?!0{32}$)[0-9a-f]{32}$", description="W3C trace id")]
SpanId = Annotated[str, msgspec.Meta(pattern="^(?!0{16}$)[0-9a-f]{16}$", description="W3C span id")]

# The HTTP header carrying the producer key (``ledger.producers``): a random secret the exporter draws
# once per source and keeps in its spool folder.
PRODUCER_HEADER = "x-chunkledger-producer"

# The key under which a gateway passes its request id to vLLM: ``vllm_xargs`` in the OpenAI request
# body, which vLLM copies into ``SamplingParams.extra_args``; the engine plugin keys events by it.
XARGS_KEY = "chunkledger_request_id"

FinishReason = Literal["stop", "length", "abort", "cutoff", "error"]
CommandAction = Literal["abort", "slow_pool", "non_preemptible", "promote"]


class Source(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Who sent a batch: one engine instance or one gateway instance."""

    id: Name  # stable id of the instance, e.g. "vllm-0" or "gw-eu-1"; with seq, the event identity
    kind: Literal["engine", "gateway"]  # which layers this source can see
    model: str | None = None  # served model name (engines); gateways may serve several: None


class _Event(msgspec.Struct, kw_only=True, tag_field="kind", frozen=True, omit_defaults=True):
    seq: Seq  # strictly increasing per source, in emit order; fixed before the first send
    ts: Timestamp  # when it happened (source wall clock, unix seconds)


class _RequestEvent(_Event, kw_only=True, frozen=True):
    request_id: RequestId  # external request id shared by gateway and engine


# ---------------------------------------------------------------------------------------------------
# Gateway events: the entry and admission layers.


class Arrived(_RequestEvent, tag="arrived", kw_only=True, frozen=True):
    """The gateway received the request (start of the entry layer)."""

    endpoint: str = ""  # API path, e.g. "/v1/chat/completions"
    stream: bool = False  # whether the client asked for a streamed response
    priority: Int64 = 0  # admission priority the client asked for (lower runs first)
    trace_id: TraceId | None = None  # the client's trace (its traceparent), or one the gateway started
    parent_span_id: SpanId | None = None  # the client's span that sent it; None when the gateway started it
    span_id: SpanId | None = None  # the gateway's span for the request: the parent it sends to the engine


class AdmissionEnqueued(_RequestEvent, tag="admission_enqueued", kw_only=True, frozen=True):
    """The request entered the gateway's admission queue (end of entry, start of admission)."""

    queue_depth: NonNegInt = 0  # requests already waiting in the admission queue
    entry_s: NonNegFloat | None = None  # monotonic duration arrived -> enqueued


class Admitted(_RequestEvent, tag="admitted", kw_only=True, frozen=True):
    """The gateway forwarded the request to the engine (end of the admission layer)."""

    wait_s: NonNegFloat = 0.0  # monotonic time spent in the admission queue
    in_flight: NonNegInt = 0  # requests in flight to the upstream after this one was admitted


class FirstByte(_RequestEvent, tag="first_byte", kw_only=True, frozen=True):
    """The upstream's response headers reached the gateway (vLLM sends them before it has even queued
    the request: not a token)."""

    since_arrived_s: NonNegFloat | None = None  # monotonic duration arrived -> first byte


class FirstTokenOut(_RequestEvent, tag="first_token_out", kw_only=True, frozen=True):
    """The gateway wrote the first generated content to the client: the client's time to first token
    (a streamed response: the first SSE event with a choice, as vLLM's benchmark client and the OpenAI SDK
    take it; a whole response: when its body was written)."""

    since_arrived_s: NonNegFloat | None = None  # monotonic duration arrived -> first token out


class Completed(_RequestEvent, tag="completed", kw_only=True, frozen=True):
    """The gateway finished sending the response to the client."""

    status_code: StatusCode = 200  # HTTP status sent to the client
    since_arrived_s: NonNegFloat | None = None  # monotonic duration arrived -> completed
    finish_reason: str | None = None  # finish reason seen in the response, if any
    last_token_out_s: NonNegFloat | None = None  # arrived -> the last generated content written


class ClientDisconnected(_RequestEvent, tag="client_disconnected", kw_only=True, frozen=True):
    """The client went away before the response was complete (the gateway aborts upstream)."""

    since_arrived_s: NonNegFloat | None = None  # monotonic duration arrived -> disconnect seen
    last_token_out_s: NonNegFloat | None = None  # arrived -> the last generated content written


class StreamCut(_RequestEvent, tag="stream_cut", kw_only=True, frozen=True):
    """The gateway ended a stream because of a cutoff command."""

    rule: Name  # the rule that decided the cutoff, e.g. "loop"
    command_id: str | None = None  # the command that asked for it


# ---------------------------------------------------------------------------------------------------
# Engine events: the backend wait and batch layers.


class Queued(_RequestEvent, tag="queued", kw_only=True, frozen=True):
    """The engine's scheduler received the request (start of backend wait)."""

    prompt_tokens: NonNegInt  # prompt length in tokens
    max_tokens: NonNegInt | None = None  # output cap the client asked for; None when unbounded
    arrival_ts: Timestamp | None = None  # engine front end's arrival time, when it differs from ts
    priority: Int64 = 0  # engine-side priority
    trace_id: TraceId | None = None  # the trace vLLM received (traceparent), sent only without a gateway
    parent_span_id: SpanId | None = None  # the span that sent it to vLLM, with trace_id


class Chunk(_RequestEvent, tag="chunk", kw_only=True, frozen=True):
    """A prefill chunk scheduled for the request in one engine step."""

    step: Seq  # the engine step (see Step.step) that runs this chunk
    tokens: NonNegInt  # prefill tokens scheduled this step
    computed_before: NonNegInt  # tokens already computed (or cached) before this chunk: its depth
    recomputed_tokens: NonNegInt = 0  # of `tokens`, how many had been computed before and were lost
    # to a preemption (the source knows how far the request ever got; the rest are new prompt tokens)
    cached_tokens: NonNegInt = 0  # prefix-cache hits, on the request's first chunk only
    kv_blocks: NonNegInt = 0  # KV blocks the request holds after this step's allocation
    preemptions: NonNegInt = 0  # preemptions so far: 0 = first pass, >0 = a pass after preemption
    wait_s: NonNegFloat | None = None  # first chunk only: monotonic wait queued -> first scheduled


class Tokens(_RequestEvent, tag="tokens", kw_only=True, frozen=True):
    """Output tokens produced since the request's previous tokens event (coalesced per flush).

    ``ts`` is the time of the last token in the group, ``first_ts`` of the first one.
    """

    count: NonNegInt  # new output tokens in this group
    total: NonNegInt  # output tokens so far, this group included
    first_ts: Timestamp | None = None  # wall time of the group's first token (None: same as ts)
    kv_blocks: NonNegInt = 0  # KV blocks held at the last token
    token_ids: list[NonNegInt] | None = None  # the new token ids, for detectors; not persisted by default


class Preempted(_RequestEvent, tag="preempted", kw_only=True, frozen=True):
    """The engine preempted the request: its KV blocks were freed and it went back to waiting."""

    reason: str = "kv_pressure"  # why, e.g. "kv_pressure", "priority"
    kv_blocks_freed: NonNegInt = 0  # blocks released
    computed_tokens: NonNegInt = 0  # tokens computed before preemption (recomputed unless cached)


class Resumed(_RequestEvent, tag="resumed", kw_only=True, frozen=True):
    """A preempted request was scheduled again."""

    wait_s: NonNegFloat = 0.0  # monotonic time from its preemption to now
    cached_tokens: NonNegInt = 0  # tokens found in the prefix cache on resume
    output_tokens: NonNegInt = 0  # output tokens it had produced when preempted (0: preempted in
    # prefill, so the wait delayed its first token; >0: the wait delayed its decode)


class Finished(_RequestEvent, tag="finished", kw_only=True, frozen=True):
    """The engine finished the request."""

    reason: FinishReason
    output_tokens: NonNegInt = 0  # output tokens produced in total
    stop_reason: str | None = None  # engine stop reason (stop string, or "chunkledger:<rule>")
    wait_s: NonNegFloat | None = None  # set when it finished while waiting: monotonic wait since
    # it was queued (never scheduled) or preempted, closing the open backend-wait interval


class CutoffApplied(_RequestEvent, tag="cutoff_applied", kw_only=True, frozen=True):
    """A source applied a command from the ledger (engines and gateways both send it)."""

    command_id: str  # id of the command, as the ledger sent it
    action: CommandAction  # what was done
    rule: Name  # the rule behind the command


class Step(_Event, tag="step", kw_only=True, frozen=True):
    """One engine step: what it ran and how long it took.

    Enough to rebuild each request's inter-token gaps (``request_ids``), to count KV idle time
    (``stalled_*``) and to fit step time against prefill tokens, prefill depth and decode batch size.
    With ``token_counts`` it also carries every request's new output tokens, columnar (schema 2): one
    entry per ``request_ids`` entry, or all three lists empty when the source sends ``tokens`` events
    instead (a source sends one or the other, never both). The tokens count as produced at the step's
    end (``ts + duration_s``). One event per step replaces a ``tokens`` event per request every few
    tokens: a GPU engine running 256 requests at 33 steps a second sends 33 events a second in place of
    about 530 (one per 16 tokens).

    ``ts`` is the step's start: its ``schedule()``, or, when the engine schedules a step while the one
    before still runs (vLLM's async scheduling), the end of that one. So ``duration_s`` is what the
    step cost the engine's cadence (the device's time for it while steps overlap), and ``ts +
    duration_s`` is when its outputs were processed.
    """

    step: Seq  # step counter of the engine, from 0
    duration_s: NonNegFloat  # monotonic time from the step's start (ts) to its outputs being processed
    prefill_tokens: NonNegInt = 0  # prefill tokens computed this step (all chunks)
    decode_tokens: NonNegInt = 0  # decode tokens computed this step
    num_prefill_reqs: NonNegInt = 0  # requests that ran a prefill chunk
    num_decode_reqs: NonNegInt = 0  # requests that ran a decode
    running: NonNegInt = 0  # requests in the running queue after scheduling
    waiting: NonNegInt = 0  # requests in the waiting queue after scheduling
    kv_usage: Ratio = 0.0  # share of the KV cache in use, 0..1
    request_ids: list[RequestId] = []  # requests scheduled this step (prefill and decode)
    prefill_depth_tokens: NonNegInt64 = 0  # sum over this step's chunks of tokens * computed_before:
    # the attention work that grows with prefill depth (for the chunk-size fit)
    max_prefill_depth: NonNegInt = 0  # deepest chunk start (computed_before) among this step's chunks
    stalled_request_ids: list[RequestId] = []  # requests holding KV blocks that got no token this step
    # (a chunked prefill or a decode left out of the batch): their KV sat idle for duration_s
    stalled_kv_blocks: list[NonNegInt] = []  # KV blocks each stalled request held, same order
    # and length as stalled_request_ids (or empty: unknown)
    token_counts: list[NonNegInt] = []  # output tokens each request got from this step (0: none,
    # e.g. a chunk that left its prefill partial; more than 1 with speculative decoding)
    token_totals: list[NonNegInt] = []  # output tokens each request has after this step
    token_ids: list[NonNegInt] = []  # the new token ids, flattened in request_ids order
    # (sum(token_counts) of them; empty when ids are not sent); for the loop detector, never stored

    def token_groups(self) -> Iterator[tuple[str, int, int, list[int]]]:
        """``(request_id, count, total, ids)`` for each request that got output tokens from this step
        (``ids`` empty when the source does not send them): what a ``tokens`` event would say."""
        if not self.token_counts:
            return
        ids = self.token_ids
        at = 0
        for rid, count, total in zip(self.request_ids, self.token_counts, self.token_totals, strict=True):
            if count:
                yield rid, count, total, ids[at : at + count]
                at += count


class Dropped(_Event, tag="dropped", kw_only=True, frozen=True):
    """The source's exporter had to drop events (queue and spool full); their seqs are missing."""

    count: NonNegInt  # events dropped since the previous marker
    reason: Name  # e.g. "queue_full", "spool_full"
    first_ts: Timestamp | None = None  # when the first of them was dropped


Event = (
    Arrived
    | AdmissionEnqueued
    | Admitted
    | FirstByte
    | FirstTokenOut
    | Completed
    | ClientDisconnected
    | StreamCut
    | Queued
    | Chunk
    | Tokens
    | Preempted
    | Resumed
    | Finished
    | CutoffApplied
    | Step
    | Dropped
)

EVENT_TYPES: dict[str, type[_Event]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (
        Arrived,
        AdmissionEnqueued,
        Admitted,
        FirstByte,
        FirstTokenOut,
        Completed,
        ClientDisconnected,
        StreamCut,
        Queued,
        Chunk,
        Tokens,
        Preempted,
        Resumed,
        Finished,
        CutoffApplied,
        Step,
        Dropped,
    )
}
GATEWAY_KINDS = frozenset(
    {
        "arrived",
        "admission_enqueued",
        "admitted",
        "first_byte",
        "first_token_out",
        "completed",
        "client_disconnected",
        "stream_cut",
    }
)
ENGINE_KINDS = frozenset(EVENT_TYPES) - GATEWAY_KINDS - {"dropped", "cutoff_applied"}


class Batch(msgspec.Struct, kw_only=True):
    """The body of ``POST /v1/events``."""

    source: Source
    events: list[Event]
    schema_version: int = SCHEMA_VERSION


class Command(msgspec.Struct, kw_only=True, frozen=True):
    """An action the ledger asks a source to apply to one of its requests."""

    id: str  # command id; the source confirms with a cutoff_applied event carrying it
    request_id: RequestId
    action: CommandAction
    rule: Name  # the rule that decided it; engines report it as stop reason "chunkledger:<rule>"
    detail: str = ""  # human-readable detail, e.g. "period 3 repeated 40 times"


class IngestResponse(msgspec.Struct, kw_only=True):
    """The answer to ``POST /v1/events``: sent only after the batch is durably stored."""

    accepted: int  # events stored by this request
    duplicates: int  # events already stored before (same source and seq)
    commands: list[Command] = []  # commands for this source, re-sent until confirmed


class CommandsResponse(msgspec.Struct, kw_only=True):
    """The answer to ``GET /v1/commands?source_id=...&wait_s=...`` (long-poll)."""

    commands: list[Command] = []  # the source's unconfirmed commands, re-sent until confirmed


batch_encoder = msgspec.json.Encoder()
batch_decoder = msgspec.json.Decoder(Batch)
response_decoder = msgspec.json.Decoder(IngestResponse)
commands_decoder = msgspec.json.Decoder(CommandsResponse)


def encode_batch(source: Source, events: list[Event]) -> bytes:
    return batch_encoder.encode(Batch(source=source, events=events))
