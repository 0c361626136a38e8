"""Service settings: one pydantic-settings object, env prefix ``CHUNKLEDGER_``."""

from __future__ import annotations

import ipaddress
from functools import lru_cache

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ledger.defaults import DEFAULT_DB_URL, DEFAULT_PORT


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHUNKLEDGER_", extra="ignore")

    db_url: str = Field(
        DEFAULT_DB_URL,
        description="SQLAlchemy URL: duckdb:///path or postgresql+psycopg://user@host/db "
        "(null:// stores nothing: benchmarks only)",
    )
    host: str = Field("127.0.0.1", description="bind address; a non-loopback one needs all three tokens set")
    port: int = Field(DEFAULT_PORT, ge=1, le=65535, description="port to listen on")
    ingest_token: str = Field(
        "", description="bearer token for POST /v1/events and GET /v1/commands (empty: open, loopback only)"
    )
    read_token: str = Field("", description="bearer token for the read API (empty: open, loopback only)")
    admin_token: str = Field(
        "",
        description="bearer token for the policy and webhook endpoints; also accepted wherever the others "
        "are",
    )
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="a larger request body gets 413")
    body_timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="a request body that stops arriving for this long (e.g. a Content-Length larger than "
        "the body) gets 408",
    )
    max_events_per_batch: int = Field(20_000, ge=1, description="a batch with more events gets 422")
    group_commit_max_events: int = Field(
        50_000, ge=1, description="most events the writer stores in one transaction"
    )
    max_clock_ahead_s: float = Field(
        300.0,
        ge=0,
        description="event timestamps further than this ahead of the ledger's clock are stored as the "
        "receive time (counted in chunkledger_ingest_future_timestamps_total)",
    )
    persist_token_ids: bool = Field(
        False, description="keep output token ids in events.data (they are user content)"
    )
    policy_file: str = Field(
        "",
        description="runaway policy (TOML/YAML/JSON) loaded at start; empty: the stored one, else the "
        "defaults",
    )
    metrics_token: str = Field("", description="bearer token for GET /metrics (empty: the read token)")
    webhook_max_attempts: int = Field(
        8, ge=1, le=100, description="attempts before a webhook delivery is dead-lettered"
    )
    webhook_backoff_s: float = Field(
        1.0, gt=0, description="first webhook retry delay (doubles, with ±50% jitter)"
    )
    webhook_backoff_max_s: float = Field(300.0, gt=0, description="longest webhook retry delay")
    webhook_allow: str = Field(
        "",
        description="networks (CIDR) and host names webhooks may go to besides public addresses, comma "
        "separated (e.g. 10.20.0.0/16,relay.internal); private, loopback, link-local and metadata "
        "targets are refused otherwise",
    )
    webhook_timeout_s: float = Field(5.0, gt=0, le=120, description="webhook HTTP timeout per attempt")
    log_level: str = Field("info", description="log level: debug, info, warning or error")
    gc_tuning: bool = Field(
        True,
        description="chunkledger serve: after start-up, gc.freeze() and young-generation collections every "
        "50,000 allocations instead of 700 (fewer garbage-collector passes on the ingest path)",
    )
    sql_timeout_s: float = Field(10.0, gt=0, le=3600, description="POST /v1/sql: time limit per query")
    sql_max_rows: int = Field(
        10_000, ge=1, le=1_000_000, description="POST /v1/sql: most rows one query returns"
    )
    sql_max_bytes: int = Field(
        32 * 1024 * 1024,
        ge=1024,
        description="POST /v1/sql: about the most bytes of values one answer holds (then truncated_by=bytes)",
    )
    sql_reader_url: str = Field(
        "", description="PostgreSQL: URL of the read-only role /v1/sql connects as (`chunkledger sql-reader`)"
    )

    @field_validator("sql_reader_url")
    @classmethod
    def _reader_is_postgres(cls, v: str) -> str:
        if v and not v.startswith("postgresql"):
            raise ValueError("sql_reader_url must be a postgresql URL (the read-only role for /v1/sql)")
        return v

    @field_validator("db_url")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if not v.startswith(("duckdb://", "postgresql", "null://")):
            raise ValueError("db_url must start with duckdb:// or postgresql (e.g. postgresql+psycopg://...)")
        return v

    def check_safe_to_bind(self) -> None:
        """Refuse a non-loopback bind while any token is empty (anyone could write or read)."""
        if is_loopback(self.host):
            return
        empty = [
            name
            for name, value in (
                ("CHUNKLEDGER_INGEST_TOKEN", self.ingest_token),
                ("CHUNKLEDGER_READ_TOKEN", self.read_token),
                ("CHUNKLEDGER_ADMIN_TOKEN", self.admin_token),
            )
            if not value
        ]
        if empty:
            raise UnsafeConfig(
                f"refusing to bind {self.host}: a non-loopback address needs tokens; set {', '.join(empty)}"
            )


class UnsafeConfig(ValueError):
    pass


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@lru_cache
def get_settings() -> Settings:
    return Settings()
