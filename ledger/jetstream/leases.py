"""Which partitions of the stream this worker consumes: PostgreSQL advisory locks, one per partition.

Each worker holds, on a connection of its own, one lock that says it is alive (a slot among
``MAX_WORKERS``) and one lock per partition it consumes. PostgreSQL releases a session's locks when its
connection ends, so a worker killed with ``kill -9`` (or cut off from the database) frees its partitions
at once, and no worker can consume a partition another holds: the database the workers write to is
also the one that says who writes what.

``balance()`` (every ``interval_s``) moves toward an even share: with ``n`` live workers each holds at
most ``ceil(partitions / n)``; one over its share hands the extra partitions back (its consumer stops
first), one under it takes free ones. A worker that joins therefore takes partitions within a tick or
two of the others' handing them back, and the partitions of one that dies are taken within a tick.
"""

from __future__ import annotations

import logging
import math
import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

log = logging.getLogger(__name__)

MAX_WORKERS = 256


def lock_space(stream: str, what: str) -> int:
    """The first key of the advisory locks of ``what`` ("workers", "partitions") of one stream: a
    positive int4, so that two streams in one database, or another application's locks, do not mix."""
    return zlib.crc32(f"chunkledger:{stream}:{what}".encode()) & 0x7FFFFFFF


def libpq_url(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL as libpq takes it (no ``+driver``)."""
    return sa.engine.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


_HOLDERS = (
    "SELECT objid::bigint, pid FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objsubid = 2 "
    "AND granted"
)


def holders(db_url: str, stream: str) -> dict[int, int]:
    """partition -> the PostgreSQL backend pid holding its lease (one per worker), for operators,
    benches and tests; from a connection of its own."""
    import psycopg

    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        rows = conn.execute(_HOLDERS, (lock_space(stream, "partitions"),)).fetchall()
    return {int(p): int(pid) for p, pid in rows}


@dataclass
class Change:
    """What a balance changed: the partitions taken and those to hand back."""

    taken: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)


class Leases:
    """This worker's locks (see the module docstring). Not thread-safe: one caller, the worker's loop."""

    def __init__(self, db_url: str, stream: str, partitions: int) -> None:
        import psycopg

        self.partitions = partitions
        self._workers = lock_space(stream, "workers")
        self._parts = lock_space(stream, "partitions")
        self._conn: Any = psycopg.connect(libpq_url(db_url), autocommit=True)
        self.slot: int | None = None
        self.held: set[int] = set()

    def _try(self, space: int, key: int) -> bool:
        row = self._conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (space, key)).fetchone()
        return bool(row[0])

    def join(self) -> int:
        """Take a worker slot (this worker counts as live from now on); its number."""
        for slot in range(MAX_WORKERS):
            if self._try(self._workers, slot):
                self.slot = slot
                return slot
        raise RuntimeError(f"more than {MAX_WORKERS} workers on this stream")

    def _granted(self, space: int) -> list[int]:
        return [int(r[0]) for r in self._conn.execute(_HOLDERS, (space,)).fetchall()]

    def live_workers(self) -> int:
        return max(1, len(self._granted(self._workers)))

    def share(self) -> int:
        """The most partitions this worker should hold now."""
        return math.ceil(self.partitions / self.live_workers())

    def balance(self) -> Change:
        """One step toward this worker's share: the partitions to stop consuming (``released``: hand
        them back with ``release`` once their consumers stopped) and those it now holds (``taken``)."""
        change = Change()
        share = self.share()
        if len(self.held) > share:
            change.released = sorted(self.held)[share:]
            return change
        if len(self.held) < share:
            taken_by_all = set(self._granted(self._parts))
            free = [p for p in range(self.partitions) if p not in taken_by_all]
            random.shuffle(free)  # workers that start together do not all reach for partition 0 first
            for p in free:
                if len(self.held) >= share:
                    break
                if self._try(self._parts, p):
                    self.held.add(p)
                    change.taken.append(p)
        return change

    def release(self, partitions: list[int]) -> None:
        for p in partitions:
            if p in self.held:
                self._conn.execute("SELECT pg_advisory_unlock(%s, %s)", (self._parts, p))
                self.held.discard(p)

    def owners(self) -> dict[int, int]:
        """partition -> the backend pid holding it (for the operators' view)."""
        rows = self._conn.execute(_HOLDERS, (self._parts,)).fetchall()
        return {int(p): int(pid) for p, pid in rows}

    def close(self) -> None:
        """Leave: every lock goes with the connection."""
        try:
            self._conn.close()
        finally:
            self.held.clear()
            self.slot = None
