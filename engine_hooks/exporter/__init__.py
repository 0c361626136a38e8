"""The engine-side exporter: a non-blocking, lossless path from a source's hooks to the ledger.

Shape (OpenTelemetry's BatchProcessor, plus a disk spool and a window of POSTs in flight)::

    engine thread            worker thread (daemon)                 sender threads (max_in_flight)
    emit -> bounded deque -> take -> number (seq) -> encode
            (never blocks,        |  window has room, no backlog: ---->  POST /v1/events, retries with
             never raises)        |                                      backoff + jitter; counts the answer
                                  |  settle outcomes oldest first  <---  commands -> on_command (host)
                                  |    failed fresh batch -> spool (the backlog)
                                  |  backlog: replay it oldest first, spooled batches merged into
                                  |    POSTs of replay_max_events, max_in_flight at a time
                                  v  ledger backing off: fresh batches go to the spool behind the backlog

One concept per module:

* ``queue``: the bounded event queue and the emit fast path (``emitter``, ``emit``, admission, drops),
  and ``WorkerQueue``, all the worker may do with it;
* ``encode``: numbering and encoding (``Prepared``), merging spooled batches (``merge_records``);
* ``batcher``: the worker thread (the in-flight window, spool replay, settling outcomes in order);
* ``window``: the jobs in flight and the sender threads that POST them;
* ``transport``: one POST and its status rules, with retries (``Outcome``, ``SendResult``);
* ``commands``: the command long-poller and de-duplicator (the gateway's too);
* ``stats``: ``ExporterStats`` and the counters; ``logonce``: rate-limited logging;
* ``core``: ``Exporter``, which holds the queue and wires the rest, and the process life cycle (fork, exit).

The spool is ``engine_hooks.spool``; the Prometheus view of the stats is ``engine_hooks.metrics``.
"""

from engine_hooks.exporter.commands import CommandCallback, CommandDeduper, CommandPoller
from engine_hooks.exporter.core import Exporter
from engine_hooks.exporter.core import _live as _live
from engine_hooks.exporter.encode import Prepared, merge_records
from engine_hooks.exporter.logonce import log
from engine_hooks.exporter.queue import Emitter
from engine_hooks.exporter.stats import ExporterStats
from engine_hooks.exporter.transport import Outcome, SendResult

__all__ = [
    "CommandCallback",
    "CommandDeduper",
    "CommandPoller",
    "Emitter",
    "Exporter",
    "ExporterStats",
    "Outcome",
    "Prepared",
    "SendResult",
    "log",
    "merge_records",
]
