"""Read concurrency: how many read routes run at once, in all and per client address.

A read past either limit is refused at once with 429 and ``Retry-After`` (``ledger.api.gate``), before
it takes a worker thread or a database connection: 300 concurrent ``/v1/sql`` cost 300 quick refusals,
not 300 threads waiting for a slot while ingest's token check queues behind them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Busy:
    """Why a read was refused: the setting whose limit was reached, and that limit."""

    limit: str
    value: int

    @property
    def detail(self) -> str:
        scope = "in all" if self.limit == "read_max_concurrent" else "for this client address"
        return f"{self.limit}: {self.value} reads are already running {scope}; retry shortly"


class ReadSlots:
    """Counters of the reads running, in all and per client (the event loop's thread only: no lock)."""

    def __init__(self, max_total: int, max_per_client: int) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.running = 0
        self._by_client: dict[str, int] = {}

    def acquire(self, client: str) -> Busy | None:
        """Take a slot for ``client``; the limit reached instead (nothing taken)."""
        if self.running >= self.max_total:
            return Busy("read_max_concurrent", self.max_total)
        mine = self._by_client.get(client, 0)
        if mine >= self.max_per_client:
            return Busy("read_max_concurrent_per_client", self.max_per_client)
        self.running += 1
        self._by_client[client] = mine + 1
        return None

    def release(self, client: str) -> None:
        self.running -= 1
        left = self._by_client[client] - 1
        if left:
            self._by_client[client] = left
        else:
            del self._by_client[client]
