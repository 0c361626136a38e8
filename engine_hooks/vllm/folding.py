"""The steps' outputs folded off the engine thread, while the engine waits for the device.

What the reporter does with a step's outputs (each request's new tokens coalesced into ``tokens``
events, its finish) is about a microsecond a request, most of it reaching request state that has gone
cold in the CPU's caches since the previous step: on a GPU-shaped step (the engine thread waits 30 ms
for the device) about 330 µs of engine-thread time at 256 running requests, more than the goal for all
the hooks together (``bench.vllm_async --device-ms 30``). On GPU the engine thread spends most of a
step blocked on the device with the GIL released, so :class:`OutputFolder` takes the work there:
``update_from_output()`` only queues the step's output lists (a copy of each list, no per-request
work) and wakes the folder's thread, which folds them while the engine waits.

Exactness: a step's outputs are folded whole, in order, with the wall clock and engine clock of their
``update_from_output()``, by the reporter's own code, so every event carries what it carried when folded
on the engine thread; only when it is emitted moves (a step later at most, well inside the
``tokens_flush_s`` coalescing the ledger already allows for). The hooks hold :attr:`OutputFolder.lock`
whenever they touch request state, so a fold never runs beside them; where a hook needs the folded state
(a preemption, a frontend abort, a command, a policy, the ``step_tokens`` columns, shutdown, or an
exporter flush) it folds what is queued first, on its own thread (:meth:`OutputFolder.drain`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

# Folders of this process, to be reset in a forked child (whose copy of the thread does not run).
_FOLDERS: weakref.WeakSet[OutputFolder] = weakref.WeakSet()


class OutputFolder:
    """A queue of steps' outputs, folded by ``fold(*item)`` on a thread of its own or by :meth:`drain`.

    ``on_error(where)`` is called (on the folder's thread) when a fold raises; the item is dropped and
    the thread goes on.
    """

    def __init__(self, fold: Callable[..., None], on_error: Callable[[str], None], name: str):
        self._fold = fold
        self._on_error = on_error
        self._name = name
        self._queue: deque[tuple[Any, ...]] = deque()
        self.lock = threading.RLock()  # held by the hooks while they touch request state, and by folds
        self._reset()
        self.folded = 0  # steps' outputs folded
        self.folded_off = 0  # of them, on the folder's own thread
        self.seconds = 0.0  # time spent folding on the folder's thread (wall)
        self.cpu_seconds = 0.0  # and that thread's CPU time in it
        _FOLDERS.add(self)

    def _reset(self) -> None:
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    def put(self, *item: Any) -> None:
        """Queue one step's outputs (engine thread) and wake the folder."""
        self._queue.append(item)
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        if not self._wake.is_set():
            self._wake.set()

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self) -> None:
        """Fold everything queued, in order, on the calling thread."""
        if not self._queue:
            return
        with self.lock:
            queue = self._queue
            own = threading.current_thread() is self._thread
            while queue:
                item = queue.popleft()
                self.folded += 1
                self.folded_off += own
                self._fold(*item)

    def close(self, timeout: float = 5.0) -> None:
        """Fold what is queued and stop the thread."""
        self._closed = True
        self._wake.set()
        self.drain()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        wake = self._wake
        while True:
            wake.wait()
            wake.clear()
            t0, c0 = time.perf_counter(), time.thread_time()
            while self._queue:
                try:
                    self.drain()
                except Exception:
                    self._on_error("fold")
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.thread_time() - c0
            if self._closed:
                return


def _after_fork_in_child() -> None:
    for folder in list(_FOLDERS):
        folder.lock._at_fork_reinit()  # type: ignore[attr-defined]  # a parent thread may have held it
        folder._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["OutputFolder"]
