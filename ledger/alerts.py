"""The alerts: what each webhook event type carries, one record per type, and the bodies posted.

The runaway service raises them (``ledger.runaway``: cutoffs, starvation and data loss; the SLO watch,
``ledger.rules.slo``: SLO breaches) and the outbox posts them (``ledger.webhooks.outbox``). A subscriber
in the ``json`` format is posted ``{"data", "id", "ts", "type"}`` (the alert's :data:`BODIES` record,
tagged by ``type``: the event type), one in the ``text`` format ``{"text": ...}`` (:class:`TextBody`).
Each is written with ``json.dumps`` (the json format's keys sorted), as the outbox always has: a
receiver checks the signature on those bytes.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec

from ledger.records import Record

SloMetric = Literal["ttft", "itl"]
SloState = Literal["firing", "resolved"]


class Alert(Record, kw_only=True):
    """Base of the alerts; ``event_type`` (not a field) is the webhook event type of the record."""

    event_type: ClassVar[str]


class CutoffAlert(Alert, kw_only=True):
    """``cutoff``: a rule decided to cut a request (the decision stored in ``cutoffs``)."""

    event_type: ClassVar[str] = "cutoff"

    command_id: str
    request_id: str
    model: str | None
    rule: str
    action: str
    detail: str
    source_id: Annotated[str | None, msgspec.Meta(description="the engine source running the request")]
    gateway_source_id: Annotated[str | None, msgspec.Meta(description="the gateway streaming it, if one")]
    decided_ts: float


class SloBreachAlert(Alert, kw_only=True):
    """``slo_breach``: a model's p99 went over its target (``firing``) or back under it (``resolved``)."""

    event_type: ClassVar[str] = "slo_breach"

    model: str
    metric: SloMetric
    state: SloState
    p99_s: float
    target_s: float
    samples: Annotated[int, msgspec.Meta(description="finished requests in the window")]
    window_s: float


class StarvationAlert(Alert, kw_only=True):
    """``starvation``: a request has waited longer than the policy's bound."""

    event_type: ClassVar[str] = "starvation"

    request_id: str
    model: str | None
    source_id: str | None
    waited_s: float
    bound_s: float | None
    preemptions: int


class DataLossAlert(Alert, kw_only=True):
    """``data_loss``: a source's exporter dropped events."""

    event_type: ClassVar[str] = "data_loss"

    source_id: str
    model: str | None
    count: int
    reason: str
    ts: float


ALERTS: tuple[type[Alert], ...] = (CutoffAlert, SloBreachAlert, StarvationAlert, DataLossAlert)
EVENT_TYPES = tuple(a.event_type for a in ALERTS)


def _body(alert: type[Alert]) -> Any:
    """The json format's body for ``alert``: the event's id and time, its type (the tag) and the alert."""
    record: Any = msgspec.defstruct(
        alert.__name__.removesuffix("Alert") + "Body",
        [("id", str), ("ts", float), ("data", alert)],
        bases=(Record,),
        kw_only=True,
        tag_field="type",
        tag=alert.event_type,
        module=__name__,
    )
    record.__doc__ = f"A ``{alert.event_type}`` event as posted to a json subscriber."
    return record


BODIES: dict[type[Alert], Any] = {alert: _body(alert) for alert in ALERTS}
AlertBody: Any = Union[tuple(BODIES.values())]  # noqa: UP007 - a union of classes made at run time


class TextBody(Record, kw_only=True):
    """Any event as posted to a text subscriber: one line for chat tools (Slack's ``text``)."""

    text: str
