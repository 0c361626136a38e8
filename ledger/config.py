"""Service settings: one pydantic-settings object, env prefix ``CHUNKLEDGER_``."""

from __future__ import annotations

import ipaddress
from functools import lru_cache

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DB_URL = "duckdb:///./chunkledger.duckdb"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CHUNKLEDGER_", extra="ignore")

    db_url: str = Field(DEFAULT_DB_URL, description="SQLAlchemy URL: duckdb:///file or postgresql+psycopg://")
    host: str = "127.0.0.1"
    port: int = Field(8321, ge=1, le=65535)
    ingest_token: str = ""  # bearer token for POST /v1/events (empty: no auth, loopback only)
    read_token: str = ""  # bearer token for the read API
    admin_token: str = ""  # bearer token for admin endpoints; also allowed wherever the others are
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="413 above this request body size")
    body_timeout_s: float = Field(
        5.0, gt=0, le=600, description="408 when a request body stops arriving for this long"
    )
    max_events_per_batch: int = Field(20_000, ge=1)
    group_commit_max_events: int = Field(50_000, ge=1, description="events per storage transaction")
    max_clock_ahead_s: float = Field(
        300.0,
        ge=0,
        description="event timestamps further than this ahead of the ledger's clock are stored as the "
        "receive time (counted in chunkledger_ingest_future_timestamps_total)",
    )
    persist_token_ids: bool = False  # store output token ids in events.data (they are user content)
    policy_file: str = Field(
        "", description="runaway policy (TOML/YAML/JSON) loaded at start; empty: stored or defaults"
    )
    metrics_token: str = ""  # bearer token for GET /metrics (empty: /metrics takes the read token)
    webhook_max_attempts: int = Field(8, ge=1, le=100, description="webhook attempts before dead-letter")
    webhook_backoff_s: float = Field(
        1.0, gt=0, description="first webhook retry delay (doubles, with jitter)"
    )
    webhook_backoff_max_s: float = Field(300.0, gt=0, description="longest webhook retry delay")
    webhook_allow: str = Field(
        "",
        description="networks (CIDR) and host names webhooks may go to besides public addresses, comma "
        "separated (e.g. 10.20.0.0/16,relay.internal); private, loopback, link-local and metadata "
        "targets are refused otherwise",
    )
    webhook_timeout_s: float = Field(5.0, gt=0, le=120, description="webhook HTTP timeout per attempt")
    log_level: str = "info"
    gc_tuning: bool = Field(
        True, description="chunkledger serve: fewer garbage-collector passes on the ingest path (gc.freeze)"
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
