"""Event-loop watchdog: notices when the ledger's event loop stops turning and says what blocked it.

Every ingest request, long-poll and read is answered on one asyncio loop; one blocking call on it
delays every source's batches at once. A task on the loop stamps a heartbeat every ``interval_s``; a
thread checks the stamp and, when it is older than ``threshold_s``, logs the loop thread's current
stack once per stall (and how long the stall lasted when it ends) and counts it in
``chunkledger_event_loop_stalls_total`` / ``chunkledger_event_loop_stall_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopWatchdog:
    def __init__(
        self,
        *,
        interval_s: float = 0.1,
        threshold_s: float = 1.0,
        on_stall: Callable[[float], None] | None = None,
    ) -> None:
        self.interval_s = interval_s
        self.threshold_s = threshold_s
        self.on_stall = on_stall  # called with the stall's length when it ends
        self.stalls = 0
        self._beat = time.monotonic()
        self._loop_thread_id: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="chunkledger-loop-watchdog", daemon=True)

    def start(self) -> None:
        """Call from the loop (the app's lifespan)."""
        self._loop_thread_id = threading.get_ident()
        self._beat = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._heartbeat())
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._thread.is_alive():
            self._thread.join(2.0)

    async def _heartbeat(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(self.interval_s)

    def _watch(self) -> None:
        stalled_since: float | None = None
        while not self._stop.wait(self.interval_s):
            beat = self._beat
            late = time.monotonic() - beat
            if late > self.threshold_s and stalled_since is None:
                stalled_since = beat
                frame = sys._current_frames().get(self._loop_thread_id or -1)
                where = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "(no frame)"
                log.warning("the event loop has not turned for %.1f s; it is at:\n%s", late, where)
            elif stalled_since is not None and beat > stalled_since:
                length = beat - stalled_since
                stalled_since = None
                self.stalls += 1
                log.warning("the event loop was blocked for %.1f s", length)
                if self.on_stall is not None:
                    self.on_stall(length)
