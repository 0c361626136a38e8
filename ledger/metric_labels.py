"""Label values that sources choose (model, source id, a dropped marker's reason), bounded for
``/metrics``.

A Prometheus series exists per distinct label value, and every histogram multiplies it by its buckets:
left as sent, a source decides how large a scrape is (a 1,000,000-character model name, or 300
distinct ones, made scrapes of 200 MB). Like Mimir's ``max_label_value_length`` and series limits,
each such label keeps at most ``cap`` distinct values, first come first served; a later value, one
longer than ``max_length`` characters or one with control characters is reported as
``other``, and ``chunkledger_metric_label_overflow_total{label, reason}`` counts each time that
happened (reason ``too_many``, ``too_long``, ``invalid``). The stored data keeps the real values:
only the metrics fold them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

OTHER = "other"
OVERFLOW_REASONS = ("too_many", "too_long", "invalid")

N = TypeVar("N", int, float)


class LabelValues:
    """The values one label may take; ``__call__`` maps a sent value to the one to export.

    One dict lookup for a value already admitted (the per-batch path); ``on_overflow(reason)`` is
    called for every value folded into ``other``.
    """

    def __init__(
        self,
        name: str,
        *,
        cap: int,
        max_length: int,
        on_overflow: Callable[[str, str], None] | None = None,
    ) -> None:
        self.name = name
        self.cap = cap
        self.max_length = max_length
        self._on_overflow = on_overflow
        self._admitted: dict[str, None] = {OTHER: None}
        self._lock = threading.Lock()

    def __call__(self, value: str | None) -> str:
        v = value or ""
        if v in self._admitted:
            return v
        return self._admit(v)

    def _admit(self, v: str) -> str:
        if len(v) > self.max_length:
            reason = "too_long"
        elif not v.isprintable():
            reason = "invalid"
        else:
            with self._lock:
                if v in self._admitted:
                    return v
                if len(self._admitted) <= self.cap:  # ``other`` is always there, beside ``cap`` values
                    self._admitted[v] = None
                    return v
            reason = "too_many"
        if self._on_overflow is not None:
            self._on_overflow(self.name, reason)
        return OTHER

    def fold(self, values: Mapping[str, N], merge: Callable[[N, N], N]) -> dict[str, N]:
        """A per-value map with its keys mapped, values that fold into one key merged."""
        out: dict[str, N] = {}
        for key, value in values.items():
            k = self(key)
            out[k] = merge(out[k], value) if k in out else value
        return out
