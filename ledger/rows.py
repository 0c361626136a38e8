"""The ledger's stored rows as the API answers them, as records made from the tables themselves
(``ledger.schema``: each field a column, described by its comment) and, for a request's events, from
the event contract's classes (``engine_hooks.events``): the ``requests`` view's row and a request's
timeline, the sources, the cutoff decisions, the webhook subscriptions and their delivery log."""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from engine_hooks import events as ev
from ledger import schema
from ledger.alerts import BODIES, TextBody
from ledger.records import SCHEMA_REF, Record, table_record

RequestRow: Any = table_record(
    "RequestRow",
    schema.requests.columns,
    module=__name__,
    doc='One row of the ``requests`` view (``chunkledger query "SELECT * FROM requests"``).',
)


class RequestList(Record, kw_only=True):
    """``GET /v1/requests``: requests whose start falls in the window, filtered, sorted, a page."""

    total: Annotated[int, msgspec.Meta(description="requests matching the filters")]
    offset: int
    limit: int
    sort: str
    rows: list[RequestRow]  # type: ignore[valid-type]


def _event_row(cls: Any) -> Any:
    """The stored form of a request event of the contract: its fields (defaults left out, as stored)
    with the source that sent it in place of the request id."""
    fields: list[Any] = [("source_id", str)]
    for f in msgspec.structs.fields(cls):
        if f.name == "request_id":
            continue
        if f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        elif f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        else:
            fields.append((f.name, f.type))
    return msgspec.defstruct(
        f"{cls.__name__}Row",
        fields,
        bases=(Record,),
        kw_only=True,
        omit_defaults=True,
        tag_field="kind",
        tag=cls.__struct_config__.tag,
        module=__name__,
    )


EVENT_ROWS = tuple(
    _event_row(cls) for cls in ev.EVENT_TYPES.values() if "request_id" in cls.__struct_fields__
)
EventRow: Any = Union[EVENT_ROWS]  # noqa: UP007 - a union of classes made at run time


class RequestDetail(Record, kw_only=True):
    """``GET /v1/requests/{request_id}``: the request's row and its events, oldest first."""

    request: RequestRow  # type: ignore[valid-type]
    events: list[EventRow]  # type: ignore[valid-type]
    trace_url: str | None = None  # the request's trace in the trace UI (CHUNKLEDGER_TRACE_URL), if set


SourceRow: Any = table_record(
    "SourceRow",
    schema.sources.columns,
    module=__name__,
    doc="A source that has sent events: its sequence high-water mark and counts; ``producer`` is the "
    "digest of the producer key its id is bound to (null: unbound, an older exporter).",
)


class Sources(Record, kw_only=True):
    """``GET /v1/sources``."""

    sources: list[SourceRow]  # type: ignore[valid-type]


CutoffRow: Any = table_record(
    "CutoffRow",
    schema.cutoffs.columns,
    module=__name__,
    doc="A stored rule decision and its command: delivery and confirmation times, and its state "
    "(pending, applied, moot or expired).",
)


class Cutoffs(Record, kw_only=True):
    """``GET /v1/cutoffs``: newest first."""

    cutoffs: list[CutoffRow]  # type: ignore[valid-type]


Webhook: Any = table_record(
    "Webhook",
    schema.webhook_subscriptions.columns,
    module=__name__,
    doc="A webhook subscription (its secret is never shown).",
    drop=("secret", "deleted_ts"),
    types={"event_types": list[str]},
)


class Webhooks(Record, kw_only=True):
    """``GET /v1/webhooks``."""

    webhooks: list[Webhook]  # type: ignore[valid-type]


class WebhookDeleted(Record, kw_only=True):
    deleted: Annotated[str, msgspec.Meta(description="the subscription's id")]


DeliveryAttempt: Any = table_record(
    "DeliveryAttempt",
    schema.webhook_attempts.columns,
    module=__name__,
    doc="One attempt to post a delivery.",
    drop=("delivery_id",),
)

# What a delivery posted: a json subscriber's alert body (tagged by ``type``) or a text subscriber's.
# msgspec cannot decode a union of tagged and untagged records, so the field holds the posted JSON as
# it was signed, and its schema is the union of those records.
POSTED_BODIES: tuple[type[Any], ...] = (*BODIES.values(), TextBody)
PostedBody = Annotated[
    Any,
    msgspec.Meta(
        extra_json_schema={"anyOf": [{"$ref": SCHEMA_REF.format(name=b.__name__)} for b in POSTED_BODIES]}
    ),
]

Delivery: Any = table_record(
    "Delivery",
    schema.webhook_outbox.columns,
    module=__name__,
    doc="A webhook delivery: what was (or will be) posted, its state (pending, delivered or dead) and "
    "its attempts.",
    drop=("lease_until",),
    types={"body": PostedBody},
    extra=[("log", list[DeliveryAttempt])],  # type: ignore[valid-type]
)


class Deliveries(Record, kw_only=True):
    """``GET /v1/webhooks/deliveries``: newest first."""

    deliveries: list[Delivery]  # type: ignore[valid-type]
