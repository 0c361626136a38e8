"""The exporter's self-metrics: the counters its threads keep and the snapshot ``Exporter.stats()`` returns.

``engine_hooks.metrics`` turns snapshots into Prometheus metrics; nothing here imports it.
"""

from __future__ import annotations

import threading
import time

import msgspec


class ExporterStats(msgspec.Struct, kw_only=True, frozen=True):
    """A snapshot of an exporter's self-metrics (``Exporter.stats()``)."""

    source_id: str
    queued: int  # events in memory waiting for the worker
    numbered: int  # events given a seq so far (markers included)
    last_seq: int | None  # the last seq given, None before the first
    sent: int  # events the ledger acknowledged (stored now or before)
    duplicates: int  # of those, events the ledger already had (re-sent after a lost answer)
    batches_sent: int  # acknowledged POSTs
    send_attempts: int  # POSTs tried
    send_failures: int  # POSTs that failed (error status, timeout, refused connection)
    retried: int  # retries of a fresh batch after a failure (before it is spooled)
    spooled: int  # events written to the spool
    replayed: int  # events delivered from the spool (or from memory after the spool was full)
    spool_bytes: int  # bytes the spool uses on disk
    spool_pending: int  # events waiting in the spool
    spool_torn_records: int  # damaged spool records skipped (their events are counted as dropped)
    dropped: dict[str, int]  # events dropped, by reason
    commands: int  # commands handed to the host callback
    last_success_ts: float | None  # wall time of the last acknowledged POST
    wire: str = "json"  # what the next batch is sent as: "json", or "columns" (the columnar message)


class Counters:
    """Delivery counters, written by the worker and the sender threads under ``lock``.

    The same lock also guards the outcome of a batch in flight (``Job.outcome`` / ``abandoned``), so
    that a batch is counted once whether its answer or shutdown's deadline comes first.
    """

    __slots__ = (
        "attempts",
        "batches_sent",
        "duplicates",
        "last_success_ts",
        "lock",
        "replayed",
        "retried",
        "send_failures",
        "sent",
        "spooled",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = self.duplicates = self.batches_sent = 0
        self.attempts = self.send_failures = self.retried = 0
        self.spooled = self.replayed = 0
        self.last_success_ts: float | None = None

    def acknowledged(self, events: int, duplicates: int) -> None:
        """Count an acknowledged POST; the caller holds ``lock``. (``replayed`` is counted when the
        worker takes a replayed batch off the spool or the memory backlog: once, however often it was
        sent.)"""
        self.sent += events
        self.batches_sent += 1
        self.duplicates += duplicates
        self.last_success_ts = time.time()
