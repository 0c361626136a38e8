"""Producer binding: a source id belongs to the producer that holds its key.

Any holder of the ingest token could otherwise send events under another source's id (stealing its
seqs, so its real events were taken as duplicates) and read or confirm its commands. Like Kafka's
idempotent producer, whose producer id and epoch fence a second producer of one transactional id,
each producer (an exporter) sends a key of its own with every request (``engine_hooks.events.
PRODUCER_HEADER``); the exporter draws it once and keeps it in its spool folder, so a restarted
producer with a spool is the same producer and delivers its old batches. The ledger stores only a
digest of it (``sources.producer``, migration 0008).

* A source with no binding is bound to the first key it is sent with.
* While bound, a batch with another key, or with none, is fenced: a 409 ``fenced`` that the exporter
  retries later (it keeps the batch). The source's commands are read only with its key.
* A binding lapses once its source has sent nothing for ``lease_s`` (its producer stopped for good,
  e.g. a crash and a restart without a spool, hence a new key); the next key then takes it over. A
  command poll with the key keeps it alive, so an idle producer keeps its id.
* A producer that stops cleanly with nothing left to send releases its binding
  (``DELETE /v1/sources/{id}/producer`` with its key): a restart takes the id over at once.

A source never sent with a key (an older exporter) stays unbound and works as before; it has no
protection (use the exporter of this version on every source that needs it).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import msgspec

from ledger.records import Record
from ledger.store import Store


def digest(key: str | None) -> str | None:
    """What the ledger keeps of a producer key (a reader of ``sources`` cannot send with it)."""
    if not key:
        return None
    return hashlib.sha256(key.encode()).hexdigest()[:32]


@dataclass
class _Binding:
    producer: str | None  # the digest the source is bound to; None: unbound
    seen: float  # when its producer was last heard from (wall clock)


class ProducerReleased(Record, kw_only=True):
    """``DELETE /v1/sources/{id}/producer``: the producer's release of its source id."""

    source_id: Annotated[str, msgspec.Meta(description="the source id released")]
    released: Annotated[
        bool,
        msgspec.Meta(
            description="true: it was bound to this producer and is now free; false: it was not bound"
        ),
    ]


class ProducerBook:
    """The binding of each source id met, read from ``sources`` on first sight."""

    def __init__(self, store: Store, *, lease_s: float, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.lease_s = lease_s
        self._clock = clock
        self._lock = threading.Lock()
        self._bindings: dict[str, _Binding] = {}

    def current(self, source_id: str, producer: str | None) -> bool:
        """Whether memory already says ``producer`` may send for ``source_id`` (the per-batch path: no
        database); renews the binding. False: ask ``claim``."""
        b = self._bindings.get(source_id)
        if b is None or b.producer != producer:
            return False
        b.seen = self._clock()
        return True

    def claim(self, source_id: str, producer: str | None) -> float | None:
        """Whether ``producer`` may send for ``source_id`` now: None (it may; an unbound or lapsed source
        is bound to it), else the seconds until the current binding lapses. Reads the stored binding
        (another replica may have bound the source meanwhile)."""
        stored, stored_seen = self.store.source_producer(source_id)
        now = self._clock()
        with self._lock:
            b = self._bindings.get(source_id)
            seen = max(stored_seen or 0.0, b.seen if b is not None and b.producer == stored else 0.0)
            b = self._bindings[source_id] = _Binding(stored, seen)
            if b.producer == producer:
                b.seen = now
                return None
            left = b.seen + self.lease_s - now
            if b.producer is not None and left > 0:
                return left
            if producer is not None:  # an unbound or lapsed source: this producer's now
                b.producer = producer
            b.seen = now
            return None

    def release(self, source_id: str, producer: str | None) -> bool | None:
        """``producer`` stops for good: unbind ``source_id`` now (stored too), so that the next producer
        need not wait out the lease. True: released; False: it was not bound; None: it is bound to
        another producer (nothing changes)."""
        stored, _ = self.store.source_producer(source_id)
        with self._lock:
            if stored is None:
                self._bindings.pop(source_id, None)
                return False
            if stored != producer:
                return None
            self.store.release_producer(source_id, producer)
            self._bindings[source_id] = _Binding(None, 0.0)
            return True

    def owns(self, source_id: str, producer: str | None) -> bool:
        """Whether ``producer`` may read ``source_id``'s commands (its own, or an unbound source's); a
        poll by the owner keeps the binding alive."""
        if self.current(source_id, producer):
            return True
        stored, stored_seen = self.store.source_producer(source_id)
        with self._lock:
            b = self._bindings.get(source_id)
            if b is None or b.producer != stored:
                b = self._bindings[source_id] = _Binding(stored, stored_seen or 0.0)
            if b.producer is None:
                return True
            if b.producer != producer:
                return False
            b.seen = max(b.seen, self._clock())
            return True
