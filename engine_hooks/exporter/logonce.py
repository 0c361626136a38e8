"""Rate-limited logging shared by the exporter's threads (worker, senders, command poller)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("engine_hooks.exporter")


class LogOnce:
    """Logs each distinct problem once, then at most every ``interval_s`` with a count of repeats."""

    def __init__(self, interval_s: float = 60.0):
        self._interval_s = interval_s
        self._seen: dict[str, tuple[float, int]] = {}
        self._mutex = threading.Lock()  # the worker, the senders and the poller log

    def __call__(self, level: int, key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._mutex:
            last, suppressed = self._seen.get(key, (-1e18, 0))
            if now - last < self._interval_s:
                self._seen[key] = (last, suppressed + 1)
                return
            self._seen[key] = (now, 0)
        if suppressed:
            msg += f" ({suppressed} similar messages suppressed)"
        log.log(level, msg, *args, exc_info=exc_info)
