"""A request's rows as records: the ``requests`` view's row, made from the view's own columns
(``ledger.schema``: every lifecycle point, token count and layer, each with its column's comment), and
its stored events, made from the event contract's classes (``engine_hooks.events``)."""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from engine_hooks import events as ev
from ledger import schema
from ledger.records import Record


def _field(column: Any) -> tuple[str, Any]:
    kind: Any = column.type.python_type
    if column.nullable and not column.primary_key:
        kind = kind | None
    if column.comment:
        kind = Annotated[kind, msgspec.Meta(description=column.comment)]
    return str(column.name), kind


RequestRow: Any = msgspec.defstruct(
    "RequestRow",
    [_field(c) for c in schema.requests.columns],
    bases=(Record,),
    kw_only=True,
    module=__name__,
)
RequestRow.__doc__ = 'One row of the ``requests`` view (``chunkledger query "SELECT * FROM requests"``).'


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
