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
    max_body_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="POST /v1/events: a larger request body gets 413"
    )
    max_request_body_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="every other route: a larger request body gets 413 (checked before it is read)",
    )
    body_timeout_s: float = Field(
        5.0,
        gt=0,
        le=600,
        description="a request body not complete this long after its headers (a Content-Length larger "
        "than the body, or a body trickled a byte at a time) gets 408",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="a connection that has not sent a whole request head (line and headers) this long "
        "after it opened or after its previous answer is closed",
    )
    send_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="an answer the client does not take for this long (a stalled Parquet export) is "
        "abandoned: its connection closed, its database connection and transaction released",
    )
    read_max_concurrent: int = Field(
        8,
        ge=1,
        le=1000,
        description="read routes (read token: analytics, SQL, export, advice, what-if) running at once; "
        "one more gets 429 with Retry-After",
    )
    read_max_concurrent_per_client: int = Field(
        4, ge=1, le=1000, description="read routes running at once for one client address; then 429"
    )
    read_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="time limit of one read route's database work (PostgreSQL statement_timeout on the "
        "read connections; DuckDB: the query is interrupted); then 408",
    )
    read_work_mem: str = Field(
        "16MB", pattern=r"^\d+\s*(kB|MB|GB)$", description="PostgreSQL work_mem of the read connections"
    )
    read_temp_file_limit: str = Field(
        "1GB",
        pattern=r"^\d+\s*(kB|MB|GB|TB)$",
        description="PostgreSQL temp_file_limit of the read and SQL connections (setting it needs a "
        "superuser or GRANT SET ON PARAMETER; otherwise logged and left as the server's)",
    )
    duckdb_memory_limit: str = Field(
        "1GB",
        pattern=r"^\d+(\.\d+)?\s*(KB|MB|GB|TB|KiB|MiB|GiB|TiB)$",
        description="DuckDB memory_limit of the ledger's instance (DuckDB has no per-connection limit: "
        "this caps what reads and writes together may hold; a read over it gets 4xx resources)",
    )
    duckdb_threads: int = Field(2, ge=1, le=256, description="DuckDB threads of the ledger's instance")
    read_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="the threads that run reads (queries, exports, analytics, what-if) run this much nicer "
        "than ingest (Linux thread priority; DuckDB's helper threads too): on a busy host the writer "
        "gets the CPU first. 0: the same priority",
    )
    duckdb_max_temp_directory_size: str = Field(
        "4GB",
        pattern=r"^\d+(\.\d+)?\s*(KB|MB|GB|TB|KiB|MiB|GiB|TiB)$",
        description="DuckDB max_temp_directory_size: the most a spilling query may write to disk",
    )
    attribution_max_buckets: int = Field(
        10_000,
        ge=1,
        le=1_000_000,
        description="GET /v1/attribution: most time buckets (window / bucket_s) one answer may hold; "
        "more gets 422 naming bucket_s",
    )
    whatif_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="GET /v1/whatif: time limit of one replay; then 408"
    )
    auth_failures_per_minute: int = Field(
        30,
        ge=1,
        le=100_000,
        description="failed token checks one client address may make per minute; past it that address "
        "gets 429 for the rest of the minute (each failure is logged and counted)",
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
    ingest_source_events_per_s: float = Field(
        20_000.0,
        ge=0,
        description="events per second one source may send (a token bucket, burst ingest_source_burst_s "
        "of it); over it a batch gets 429 with Retry-After. 0: no limit",
    )
    ingest_source_bytes_per_s: float = Field(
        4 * 1024 * 1024,
        ge=0,
        description="request body bytes per second one source may send; over it a batch gets 429 before "
        "its body is read. 0: no limit",
    )
    ingest_source_burst_s: float = Field(
        2.0, gt=0, le=3600, description="seconds of its rate a source may send at once"
    )
    producer_lease_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="a source id stays bound to its producer's key while the producer sent a batch or "
        "polled commands within this time; another key is fenced (409) until then",
    )
    metrics_token: str = Field("", description="bearer token for GET /metrics (empty: the read token)")
    metrics_max_models: int = Field(
        8,
        ge=1,
        le=10_000,
        description="distinct model label values with series of their own in /metrics; later ones are "
        "exported as 'other' (counted in chunkledger_metric_label_overflow_total)",
    )
    metrics_max_sources: int = Field(
        64, ge=1, le=100_000, description="distinct source label values in /metrics; the rest: 'other'"
    )
    metrics_max_reasons: int = Field(
        8, ge=1, le=1000, description="distinct dropped-event reasons in /metrics; the rest: 'other'"
    )
    metrics_max_label_length: int = Field(
        128, ge=8, le=1024, description="a longer label value a source sent is exported as 'other'"
    )
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
    otlp_traces_endpoint: str = Field(
        "",
        description="OTLP/HTTP (protobuf) URL to export every finished request's spans to, e.g. "
        "`http://collector:4318/v1/traces` (empty: the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, "
        "else `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces`; none set: no export). The exporter honours "
        "the other `OTEL_EXPORTER_OTLP_*` variables (headers, timeout, compression, certificates), "
        "`OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`",
    )
    traces_max_queue_spans: int = Field(
        65_536, ge=1, description="spans waiting for the OTLP endpoint at most; more are dropped and counted"
    )
    traces_batch_spans: int = Field(512, ge=1, le=65_536, description="spans per OTLP export request at most")
    traces_delay_s: float = Field(
        1.0, gt=0, le=60, description="how often finished requests are turned into spans and sent"
    )
    trace_url: str = Field(
        "",
        description="link to a request's trace in your trace UI, `{trace_id}` replaced by its W3C trace id "
        "(e.g. `http://jaeger:16686/trace/{trace_id}`); shown by GET /v1/requests/{id} and the dashboard "
        "(empty: no link)",
    )

    @field_validator("trace_url")
    @classmethod
    def _trace_url_template(cls, v: str) -> str:
        if v and (not v.startswith(("http://", "https://")) or "{trace_id}" not in v):
            raise ValueError("trace_url must be an http(s) URL containing {trace_id}")
        return v

    def trace_link(self, trace_id: str | None) -> str | None:
        """The trace UI's page of ``trace_id`` (``trace_url``), or None."""
        if not trace_id or not self.trace_url:
            return None
        return self.trace_url.replace("{trace_id}", trace_id)

    nats_url: str = Field(
        "",
        description="NATS with JetStream (nats://host:4222, comma-separated for a cluster): this ledger is "
        "also a stream worker, "
        "consuming its share of the stream's partitions (PostgreSQL only: the workers share one database)",
    )
    nats_stream: str = Field(
        "CHUNKLEDGER", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="the JetStream stream (and subject root)"
    )
    nats_partitions: int = Field(
        16,
        ge=1,
        le=1024,
        description="partitions of the stream, set when a worker creates it (then read from the stream)",
    )
    nats_ack_wait_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="a message a worker took and did not acknowledge (stored) within this is delivered again",
    )
    nats_fetch: int = Field(
        64, ge=1, le=10_000, description="messages a worker takes from a partition at once (one group commit)"
    )
    nats_replicas: int = Field(
        1, ge=1, le=5, description="copies of the stream on a NATS cluster (when a worker creates it)"
    )
    nats_max_age_s: float = Field(
        86_400.0, gt=0, description="the stream keeps messages this long (when it creates the stream)"
    )
    nats_balance_s: float = Field(
        0.5, gt=0, le=60, description="how often a worker moves toward its even share of the partitions"
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

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, v: str) -> str:
        if v and not all(u.strip().startswith(("nats://", "tls://")) for u in v.split(",")):
            raise ValueError("nats_url must be nats:// or tls:// URLs, comma-separated for a cluster")
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
