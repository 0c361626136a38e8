"""Per-source ingest limits: events and bytes per second, as token buckets (Loki's per-tenant
``ingestion_rate``).

One source sending 16 MB batches as fast as it can made every other source's acknowledgements wait
behind its group commits (a normal source's ack p50 went to 1.7 s on DuckDB, 2.3 s on PostgreSQL).
Each source has two buckets, one of events and one of bytes, that fill at the configured rate up to
``burst_s`` seconds of it. A batch is let in while both hold something and is then charged in full
(its bytes when it is let in, its events once decoded), so a bucket may go below zero: one batch
larger than the burst still passes (a batch never becomes one that can never succeed), and the source
then waits until the debt is paid. A batch from a source in debt is refused before its body is read
(the source id is read from the body's first bytes, where the exporter puts it) with a 429 naming the
limit and ``Retry-After``: the exporter keeps the batch and sends it again then
(``engine_hooks.exporter.transport``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# The exporter's batches begin with the source (msgspec encodes fields in order): its id is in the
# first bytes. A body laid out otherwise is checked once decoded.
_SOURCE_ID = re.compile(rb'^\s*\{\s*"source"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]{1,128})"')
_PRUNE_AT = 10_000  # sources remembered before the full buckets (as good as new) are forgotten


def peek_source_id(head: bytes) -> str | None:
    """The source id at the start of a batch body, when it is where the exporter puts it."""
    m = _SOURCE_ID.match(head)
    return m.group(1).decode("utf-8", "replace") if m else None


@dataclass(frozen=True)
class Refusal:
    limit: str  # the setting, e.g. "ingest_source_events_per_s"
    rate: float  # its value
    unit: str  # "events" | "bytes"
    retry_after_s: float


@dataclass
class _Buckets:
    events: float
    bytes: float
    at: float


class SourceLimits:
    """Token buckets per source id; a rate of 0 is no limit."""

    def __init__(
        self,
        *,
        events_per_s: float,
        bytes_per_s: float,
        burst_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.events_per_s = events_per_s
        self.bytes_per_s = bytes_per_s
        self.burst_s = burst_s
        self._clock = clock
        self._lock = threading.Lock()
        self._sources: dict[str, _Buckets] = {}

    @property
    def enabled(self) -> bool:
        return self.events_per_s > 0 or self.bytes_per_s > 0

    def _refill(self, source_id: str, now: float) -> _Buckets:
        b = self._sources.get(source_id)
        cap_e, cap_b = self.events_per_s * self.burst_s, self.bytes_per_s * self.burst_s
        if b is None:
            if len(self._sources) >= _PRUNE_AT:
                self._prune(now)
            b = self._sources[source_id] = _Buckets(cap_e, cap_b, now)
            return b
        dt = now - b.at
        b.events = min(cap_e, b.events + dt * self.events_per_s)
        b.bytes = min(cap_b, b.bytes + dt * self.bytes_per_s)
        b.at = now
        return b

    def _prune(self, now: float) -> None:
        full = [
            sid
            for sid, b in self._sources.items()
            if b.events + (now - b.at) * self.events_per_s >= self.events_per_s * self.burst_s
            and b.bytes + (now - b.at) * self.bytes_per_s >= self.bytes_per_s * self.burst_s
        ]
        for sid in full:
            del self._sources[sid]

    def admit(self, source_id: str, nbytes: int) -> Refusal | None:
        """Let a batch of ``nbytes`` from the source in (charging its bytes at once, so that batches sent
        side by side see each other), or say which limit it is over and for how long."""
        if not self.enabled:
            return None
        with self._lock:
            b = self._refill(source_id, self._clock())
            if self.events_per_s > 0 and b.events < 0:
                return Refusal(
                    "ingest_source_events_per_s", self.events_per_s, "events", -b.events / self.events_per_s
                )
            if self.bytes_per_s > 0 and b.bytes < 0:
                return Refusal(
                    "ingest_source_bytes_per_s", self.bytes_per_s, "bytes", -b.bytes / self.bytes_per_s
                )
            if self.bytes_per_s > 0:
                b.bytes -= nbytes
        return None

    def charge_bytes(self, source_id: str, nbytes: int) -> None:
        """Take bytes of an admitted batch whose length was not declared."""
        if self.bytes_per_s <= 0:
            return
        with self._lock:
            self._refill(source_id, self._clock()).bytes -= nbytes

    def charge_events(self, source_id: str, events: int) -> None:
        """Take an admitted batch's events from the source's bucket (it may go below zero)."""
        if self.events_per_s <= 0:
            return
        with self._lock:
            self._refill(source_id, self._clock()).events -= events
