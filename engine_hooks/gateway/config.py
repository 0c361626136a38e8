"""Gateway settings: a validated msgspec Struct (CLI flags and tests build it with keywords)."""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from engine_hooks.settings import convert

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class GatewayConfigError(ValueError):
    """A gateway setting is invalid; the message names it and says why."""


class GatewayConfig(msgspec.Struct, kw_only=True, frozen=True):
    upstream: str  # base URL of the OpenAI-compatible server, e.g. "http://127.0.0.1:8000"
    max_in_flight: PositiveInt = 64  # requests forwarded upstream at once; the rest wait in the queue
    max_queue: NonNegInt = 1024  # requests allowed to wait; one more is answered 429 at once
    max_queue_wait_s: PositiveFloat = 30.0  # longest wait for an upstream slot; then 503
    retry_after_s: PositiveFloat = 1.0  # Retry-After sent with 429 and 503 (rounded up to whole seconds)
    connect_timeout_s: PositiveFloat = 5.0  # TCP connect to the upstream
    read_timeout_s: PositiveFloat = 300.0  # longest silence from the upstream: before its response
    # headers, between two chunks of a stream, or while reading a whole response
    header_timeout_s: PositiveFloat = 10.0  # a client connection without a whole request head this long
    # after it opened (or after its previous answer) is closed
    body_timeout_s: PositiveFloat = 30.0  # a request body not complete this long after its head gets 408
    poll_commands: bool = True  # long-poll the ledger's GET /v1/commands for cutoff commands (they also
    # arrive in ingest responses, but a quiet gateway sends few events while it streams)
    command_poll_wait_s: PositiveFloat = 20.0  # how long one long-poll may wait at the ledger (at most 60)
    priority_header: str = "x-priority"  # request header carrying the admission priority (lower first)
    request_id_header: str = "x-request-id"  # request id: taken from the client or assigned, sent upstream

    def __post_init__(self) -> None:
        if not re.match(r"^https?://[^/\s]+", self.upstream):
            raise ValueError(
                f"upstream must start with http:// or https:// and name a host, got {self.upstream!r}"
            )
        if self.command_poll_wait_s > 60:
            raise ValueError(
                f"command_poll_wait_s must be at most 60 (the ledger's limit), got {self.command_poll_wait_s}"
            )
        for name in ("priority_header", "request_id_header"):
            value = getattr(self, name)
            if not re.match(r"^[A-Za-z0-9-]{1,64}$", value):
                raise ValueError(f"{name} must be an HTTP header name (letters, digits, -), got {value!r}")

    @property
    def upstream_base(self) -> str:
        return self.upstream.rstrip("/")

    @classmethod
    def create(cls, **settings: Any) -> GatewayConfig:
        """Build from keywords; raises GatewayConfigError naming the setting that is wrong."""
        return convert(
            cls, settings, {k: k for k in settings}, what="gateway setting", error=GatewayConfigError
        )
