"""Prometheus view of exporter self-metrics.

A custom collector reads ``Exporter.stats()`` at scrape time, so the hot path pays nothing. One
collector per registry serves every exporter registered on it (the simulator runs many), labelled by
``source``. prometheus_client is imported only when a host passes a registry.

This module imports nothing from the exporter: it reads any object with a ``stats()`` method whose
snapshot looks like ``engine_hooks.exporter.ExporterStats`` (``StatsSource``), so the exporter may
import it (lazily, for ``registry=``) without a cycle.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol


class StatsSnapshot(Protocol):
    """What the collector reads of a snapshot (``ExporterStats``); other fields by name."""

    @property
    def source_id(self) -> str: ...

    @property
    def dropped(self) -> dict[str, int]: ...


class StatsSource(Protocol):
    """An exporter, as far as its metrics are concerned."""

    def stats(self) -> StatsSnapshot: ...


DROP_REASONS = ("queue_full", "spool_full", "rejected", "invalid", "spool_torn", "shutdown")

_collectors: weakref.WeakKeyDictionary[Any, _ExporterCollector] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _ExporterCollector:
    def __init__(self) -> None:
        self.exporters: weakref.WeakSet[StatsSource] = weakref.WeakSet()

    def describe(self) -> list[Any]:
        return []  # metric names are fixed, but describing would make registration collect eagerly

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        prefix = "chunkledger_exporter_"
        counters = {
            "numbered": ("events_numbered", "Events given a sequence number"),
            "sent": ("events_sent", "Events acknowledged by the ledger"),
            "duplicates": ("events_duplicate", "Acknowledged events the ledger already had"),
            "spooled": ("events_spooled", "Events written to the disk spool"),
            "replayed": ("events_replayed", "Events delivered from the spool"),
            "batches_sent": ("batches_sent", "Batches acknowledged by the ledger"),
            "send_attempts": ("send_attempts", "POSTs to the ledger tried"),
            "send_failures": ("send_failures", "POSTs to the ledger that failed"),
            "retried": ("send_retries", "Retries of a fresh batch before spooling it"),
            "spool_torn_records": ("spool_torn_records", "Damaged spool records skipped"),
            "commands": ("commands", "Ledger commands handed to the host"),
        }
        gauges = {
            "queued": ("queue_events", "Events waiting in memory for the worker"),
            "spool_bytes": ("spool_bytes", "Bytes the disk spool uses"),
            "spool_pending": ("spool_events", "Events waiting in the disk spool"),
            "last_success_ts": ("last_success_timestamp_seconds", "Unix time of the last acknowledged POST"),
        }
        snapshots = [exporter.stats() for exporter in list(self.exporters)]
        for attr, (name, doc) in counters.items():
            family = CounterMetricFamily(prefix + name, doc, labels=["source"])
            for snap in snapshots:
                family.add_metric([snap.source_id], getattr(snap, attr))
            yield family
        for attr, (name, doc) in gauges.items():
            gauge = GaugeMetricFamily(prefix + name, doc, labels=["source"])
            for snap in snapshots:
                gauge.add_metric([snap.source_id], getattr(snap, attr) or 0)
            yield gauge
        dropped = CounterMetricFamily(
            prefix + "events_dropped", "Events dropped, by reason", labels=["source", "reason"]
        )
        for snap in snapshots:
            for reason in sorted(set(DROP_REASONS) | set(snap.dropped)):
                dropped.add_metric([snap.source_id, reason], snap.dropped.get(reason, 0))
        yield dropped


def register_exporter(exporter: StatsSource, registry: Any) -> None:
    """Expose ``exporter``'s self-metrics in ``registry`` (a prometheus_client CollectorRegistry)."""
    with _lock:
        collector = _collectors.get(registry)
        if collector is None:
            collector = _collectors[registry] = _ExporterCollector()
            registry.register(collector)
        collector.exporters.add(exporter)
