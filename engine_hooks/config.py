"""Exporter settings: a validated msgspec Struct, built from keyword arguments or from the environment.

No pydantic here: this module is imported inside inference engines, so it depends on msgspec only.
Every setting has an environment variable ``CHUNKLEDGER_<NAME>`` (upper case), e.g. ``CHUNKLEDGER_URL``.
Explicit keyword arguments win over the environment. Invalid values raise :class:`ConfigError` whose
message names the variable and what it expects.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypedDict, Unpack

import msgspec

from engine_hooks.settings import convert, from_environ, is_bool_field, parse_bool

ENV_PREFIX = "CHUNKLEDGER_"

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
PollWait = Annotated[float, msgspec.Meta(ge=0, le=60)]  # the ledger holds a command long-poll 60 s at most

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SOURCE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


class ConfigError(ValueError):
    """An exporter setting is missing or invalid; the message says which and why."""


class ExporterConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Settings of one :class:`engine_hooks.exporter.Exporter` (one event source)."""

    url: str  # ledger base URL, e.g. "http://127.0.0.1:8321"; events go to {url}/v1/events
    source_id: str  # stable id of this engine or gateway instance; (source_id, seq) identifies an event
    source_kind: Literal["engine", "gateway"] = "engine"  # which event kinds this source may send
    model: str | None = None  # served model name (engines)
    ingest_token: str | None = None  # sent as "Authorization: Bearer <token>"; unset or empty: no header

    queue_size: PositiveInt = 65536  # events held in memory before emit() starts dropping
    batch_size: PositiveInt = 512  # events per POST; a full batch wakes the worker early
    flush_interval_s: PositiveFloat = 0.05  # worker timer: how often a partial batch is sent
    timeout_s: PositiveFloat = 5.0  # whole-request timeout of one POST
    connect_timeout_s: PositiveFloat = 1.0  # TCP connect timeout of one POST
    max_attempts: PositiveInt = 3  # tries of a fresh batch before it goes to the spool
    max_in_flight: PositiveInt = 4  # POSTs of fresh batches sent without waiting for the answers of the
    # ones before (a window counted from the oldest unanswered batch); 1: one at a time
    backoff_initial_s: PositiveFloat = 0.05  # first retry delay; doubles per failure (with jitter)
    backoff_max_s: PositiveFloat = 2.0  # cap of the retry delay and of the probe interval while down

    wire: Literal["json", "columns"] = "json"  # "columns": each batch as the columnar message
    # (engine_hooks/columnar.py), 2.3x fewer bytes; a ledger that does not read it answers 415 and the
    # exporter sends JSON from then on (that batch too)

    replay_max_events: PositiveInt = 8192  # a backlog is replayed in POSTs of up to this many events
    # (consecutive spooled batches merged; the ledger's default cap is 20,000 per batch), max_in_flight
    # of them at a time
    replay_max_bytes: PositiveInt = 4 << 20  # and of up to this many bytes (the ledger's default: 16 MiB)

    spool_dir: str | None = ".chunkledger/spool"  # parent folder; each source spools to spool_dir/source_id
    spool_max_bytes: NonNegInt = 256 << 20  # disk cap of the spool; 0 disables spooling
    spool_segment_bytes: PositiveInt = 8 << 20  # the spool rolls to a new file past this size
    spool_fsync: bool = True  # fsync each spooled batch (survives a machine crash, not only a process crash)

    command_poll_wait_s: PollWait = 20.0  # with an on_command callback, long-poll GET /v1/commands
    # holding each poll this long, so commands arrive even while POSTs wait on a slow ledger commit or
    # nothing is emitted; 0: commands only ride on ingest answers

    nats_url: str | None = None  # NATS with JetStream (nats://host:4222, comma-separated for a cluster):
    # batches are published to the stream, for the ledger workers behind it (engine_hooks/streams.py), and
    # commands arrive on the source's commands subject; unset: POST to url (which still answers the
    # producer release)
    nats_stream: str = "CHUNKLEDGER"  # the stream's name (letters, digits, _ and -), also its subjects' root

    seq_start: NonNegInt | None = None  # first seq; unset: microseconds since the epoch at start, so a
    # restarted source never reuses the identities of its previous run
    shutdown_timeout_s: PositiveFloat = 5.0  # how long the atexit hook lets shutdown() drain

    def __post_init__(self) -> None:
        if not re.match(r"^https?://[^/\s]+", self.url):
            raise ValueError(f"url must start with http:// or https:// and name a host, got {self.url!r}")
        if not _SOURCE_ID_RE.match(self.source_id):
            raise ValueError(
                "source_id must be 1-128 characters of letters, digits and ._:@- (starting with a letter or "
                f"digit), got {self.source_id!r}"
            )
        if self.nats_url is not None and not all(
            re.match(r"^(nats|tls)://[^/\s]+", u.strip()) for u in self.nats_url.split(",")
        ):
            raise ValueError(
                "nats_url must be nats:// or tls:// URLs naming a host, comma-separated for a cluster, got "
                f"{self.nats_url!r}"
            )
        if not re.match(r"^[A-Za-z0-9_-]{1,64}$", self.nats_stream):
            raise ValueError(f"nats_stream must be 1-64 letters, digits, _ or -, got {self.nats_stream!r}")
        if self.batch_size > self.queue_size:
            raise ValueError(f"batch_size ({self.batch_size}) must not exceed queue_size ({self.queue_size})")
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(
                f"backoff_initial_s ({self.backoff_initial_s}) must not exceed "
                f"backoff_max_s ({self.backoff_max_s})"
            )
        if self.spool_max_bytes and self.spool_segment_bytes > self.spool_max_bytes:
            raise ValueError(
                f"spool_segment_bytes ({self.spool_segment_bytes}) must not exceed spool_max_bytes "
                f"({self.spool_max_bytes})"
            )

    @property
    def events_url(self) -> str:
        return self.url.rstrip("/") + "/v1/events"

    @property
    def spool_enabled(self) -> bool:
        return self.spool_dir is not None and self.spool_max_bytes > 0

    @classmethod
    def create(cls, **settings: Unpack[ExporterSettings]) -> ExporterConfig:
        """Build from keyword arguments, raising :class:`ConfigError` with a readable message."""
        return convert(cls, settings, {k: k for k in settings}, what="exporter setting", error=ConfigError)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Unpack[ExporterSettings]
    ) -> ExporterConfig:
        """Build from ``CHUNKLEDGER_*`` variables; keyword ``overrides`` win over the environment."""
        env = os.environ if environ is None else environ
        raw, names = from_environ(cls, ENV_PREFIX, env, _parse_env_value)
        for key, value in overrides.items():
            raw[key] = value
            names[key] = key
        for required in ("url", "source_id"):
            if raw.get(required) in (None, ""):
                raise ConfigError(
                    f"{ENV_PREFIX}{required.upper()} is not set (or pass {required}=... to the exporter)"
                )
        return convert(cls, raw, names, what="exporter setting", error=ConfigError)


class ExporterSettings(TypedDict, total=False):
    """Some of :class:`ExporterConfig`'s settings by name, as keyword arguments (``create``, ``from_env``,
    overrides of the environment). ExporterConfig's fields, names and types, all optional: a field
    added there is added here (tests/engine_hooks/test_exporter_config.py holds the two equal)."""

    url: str
    source_id: str
    source_kind: Literal["engine", "gateway"]
    model: str | None
    ingest_token: str | None
    queue_size: PositiveInt
    batch_size: PositiveInt
    flush_interval_s: PositiveFloat
    timeout_s: PositiveFloat
    connect_timeout_s: PositiveFloat
    max_attempts: PositiveInt
    max_in_flight: PositiveInt
    backoff_initial_s: PositiveFloat
    backoff_max_s: PositiveFloat
    wire: Literal["json", "columns"]
    replay_max_events: PositiveInt
    replay_max_bytes: PositiveInt
    spool_dir: str | None
    spool_max_bytes: NonNegInt
    spool_segment_bytes: PositiveInt
    spool_fsync: bool
    command_poll_wait_s: PollWait
    nats_url: str | None
    nats_stream: str
    seq_start: NonNegInt | None
    shutdown_timeout_s: PositiveFloat


def _parse_env_value(name: str, var: str, value: str) -> Any:
    """Environment strings to Python values; numbers are left to msgspec's lax conversion."""
    if name in ("spool_max_bytes", "spool_segment_bytes", "replay_max_bytes"):
        return parse_size(value, var)
    if name in ("spool_dir", "model", "ingest_token", "seq_start", "nats_url"):
        return value if value.strip() else None
    if is_bool_field(ExporterConfig, name):
        return parse_bool(var, value, ConfigError)
    return value


def parse_size(value: str | int, what: str = "size") -> int:
    """``"256MiB"``, ``"64k"``, ``"1G"`` or ``"1048576"`` to bytes (binary units)."""
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(value)
    if not match:
        raise ConfigError(f"{what} must be a byte size like 1048576, 64KiB, 256MiB or 1G, got {value!r}")
    number, unit = match.groups()
    return int(number) * _SIZE_UNITS[(unit or "")[:1].lower()]
