"""What a store remembers of each source's recent steps, to link ``steps.interval_s`` whatever order
batches arrive in: a step's predecessor is the step numbered one less, scheduled at most
``MAX_STEP_GAP_S`` before it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

# A step event as ``interval_s`` needs it: (seq, ts, end = ts + duration_s).
_StepEnd = tuple[int, float, float]
# A stored step to link to a late predecessor: (the predecessor's end, source, step, the predecessor's
# seq, and the ts range the stored step's row is in).
_Link = tuple[float, str, int, int, float, float]


# Consecutive steps of one source are at most this far apart in ``ts`` (schedule time); a pair further
# apart is not linked. It bounds the ``ts`` range the out-of-order lookups and updates scan (DuckDB's zone
# maps prune the rest), and keeps a restarted engine, which numbers its steps from 0 again under the same
# source id, from being linked to the previous run's step of the same number.
MAX_STEP_GAP_S = 600.0
# Per source, the recent steps remembered for out-of-order batches: pruned to _STEPS_KEEP when above
# _STEPS_MAX (the last remembered are kept). Reordering deeper than that costs a lookup, not a wrong answer.
_STEPS_MAX = 1024
_STEPS_KEEP = 512


def _follows(prev: _StepEnd, seq: int, ts: float) -> bool:
    """Whether ``prev`` (a step numbered one less) is the predecessor of the step (seq, ts)."""
    return prev[0] < seq and abs(ts - prev[1]) <= MAX_STEP_GAP_S


@dataclass
class _StepMemory:
    """What the store knows of one source's stored steps, for ``interval_s``.

    Invariant: every step of the source stored with ``seq > floor`` is in ``ends`` (keyed by step number;
    an entry of another engine run under the same number raises ``floor`` instead). ``mark`` is the
    source's high-water mark after this store's last commit of it: a different mark under the lock means
    another writer (a PostgreSQL replica) or another process stored events since, and the memory starts
    over with ``floor`` at the new mark.
    """

    mark: int
    floor: int
    ends: dict[int, _StepEnd] = field(default_factory=dict)
    low: int | None = None  # the smallest seq above ``floor`` in ``ends`` (None: none or unknown)
    low_stale: bool = False  # ``low`` must be recomputed (an entry above ``floor`` was replaced)

    def lowest(self) -> int | None:
        if self.low_stale:
            above = [v[0] for v in self.ends.values() if v[0] > self.floor]
            self.low, self.low_stale = (min(above) if above else None), False
        return self.low

    def add(self, step: int, entry: _StepEnd) -> None:
        seq = entry[0]
        old = self.ends.get(step)
        if old is not None and old[0] != seq:  # the same number in another run of the engine
            if old[0] > seq:
                # The later run's entry stays; this one is not remembered: ``floor`` covers it.
                if seq > self.floor:
                    self.floor, self.low_stale = seq, True
                return
            if old[0] > self.floor:
                self.floor, self.low_stale = old[0], True
        self.ends[step] = entry
        if seq > self.floor and not self.low_stale and (self.low is None or seq < self.low):
            self.low = seq

    def successor_link(
        self, sid: str, step: int, seq: int, ts: float, duration: float, group: dict[int, _StepEnd]
    ) -> _Link | None:
        """For a late step (its batch was overtaken), the link to its successor stored with no interval;
        None when the successor is in the ``group`` being written (linked there) or none is stored."""
        nxt = group.get(step + 1)
        if nxt is not None and nxt[0] > seq:
            return None
        known = self.ends.get(step + 1)
        if known is not None and _follows((seq, ts, 0.0), known[0], known[1]):
            lo, hi = known[1], known[1]  # the stored successor's row
        elif seq < self.floor:
            lo, hi = ts - MAX_STEP_GAP_S, ts + MAX_STEP_GAP_S  # a successor memory cannot rule out
        else:
            return None  # none stored: memory would know it
        return (ts + duration, sid, step + 1, seq, lo, hi)

    def prune(self) -> None:
        """Forget the entries remembered first (arrival order, close to seq order: no sort)."""
        cut = len(self.ends) - _STEPS_KEEP
        if len(self.ends) <= _STEPS_MAX:
            return
        old = itertools.islice(self.ends.values(), cut)
        self.floor = max(self.floor, max(v[0] for v in old))
        self.ends = dict(itertools.islice(self.ends.items(), cut, None))
        self.low_stale = True
