"""The window of batches in flight: jobs, and the sender threads that POST them.

A sender only POSTs (retrying a fresh batch ``max_attempts`` times), counts the answer under the
counters' lock and hands the answer's commands over (once per command id) as soon as it arrives, not in
batch order; then it marks the job done and wakes the worker, which settles jobs strictly in the order
it submitted them (``batcher.py``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable

import msgspec

from engine_hooks.events import Command, response_decoder
from engine_hooks.exporter.encode import Prepared
from engine_hooks.exporter.logonce import LogOnce
from engine_hooks.exporter.stats import Counters
from engine_hooks.exporter.transport import FAILED, Outcome, Sender, SendResult
from engine_hooks.spool import SpoolPos

FRESH, SPOOLED, HELD = 0, 1, 2  # what a job sends: a fresh batch, spooled records, the oldest held batch


class Job:
    """One batch handed to a sender thread; the worker settles jobs in the order it submitted them."""

    __slots__ = ("abandoned", "attempts", "done", "end", "kind", "prepared", "records", "result")

    def __init__(
        self, kind: int, prepared: Prepared, attempts: int, end: SpoolPos | None = None, records: int = 1
    ):
        self.kind = kind
        self.prepared = prepared
        self.end = end  # spooled: the spool position just past its records (released once acknowledged)
        self.records = records  # spooled: how many spool records it merges
        self.attempts = attempts  # POSTs before giving up: max_attempts for a fresh batch, else 1
        self.result: SendResult | None = None  # set under the counters' lock once the answer is known
        self.done = False  # set after the result, once the answer's commands are handed over
        self.abandoned = False  # shutdown's deadline came first: spooled, its answer is ignored


class Senders:
    """``count`` sender threads taking jobs from one queue.

    ``record_drop(reason, n, report)`` counts a rejected batch; ``hand_over`` receives the commands of
    acknowledged batches (None: nobody wants them); ``wake`` is set when a job is done.
    """

    def __init__(
        self,
        *,
        count: int,
        name: str,
        transport: Sender,
        counters: Counters,
        record_drop: Callable[[str, int, bool], None],
        hand_over: Callable[[Command], None] | None,
        wake: threading.Event,
        stop: threading.Event,
        log: LogOnce,
    ):
        self._transport = transport
        self._counters = counters
        self._record_drop = record_drop
        self._hand_over = hand_over
        self._wake = wake
        self._stop = stop
        self._log = log
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(count)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Let each sender end after the jobs already submitted; close the transport."""
        for _ in self._threads:
            self._jobs.put(None)
        with contextlib.suppress(Exception):
            self._transport.close()

    def _loop(self) -> None:
        jobs = self._jobs
        while (job := jobs.get()) is not None:
            self._send(job)

    def _send(self, job: Job) -> None:
        """POST a batch (a fresh one with retries), record the result, wake the worker."""
        result = FAILED
        try:
            result = self._transport.send(
                job.prepared.body, attempts=job.attempts, records=job.records, stop=self._stop
            )
            if result.outcome is Outcome.ACKED:
                self._acknowledged(job, result)
            elif result.outcome is Outcome.REJECTED:
                self._rejected(job, result)
            elif result.outcome is Outcome.SPLIT:
                with self._counters.lock:
                    if not job.abandoned:
                        job.result = result
        except Exception:
            self._log(logging.ERROR, "send", "chunkledger exporter: sender error", exc_info=True)
        finally:
            with self._counters.lock:
                if job.result is None:
                    job.result = result
            job.done = True
            self._wake.set()

    def _acknowledged(self, job: Job, result: SendResult) -> None:
        """Count an acknowledged batch and hand its commands over (before it is done). A stream's
        acknowledgement has no answer (``jetstream.py``: its commands come on their own subject)."""
        answer = None
        try:
            if result.content:
                answer = response_decoder.decode(result.content)
        except msgspec.DecodeError as exc:
            self._log(logging.WARNING, "answer", "chunkledger exporter: unreadable ingest answer: %s", exc)
        with self._counters.lock:
            if job.abandoned:  # shutdown spooled it meanwhile: a replay will be counted as duplicates
                return
            job.result = result
            self._counters.acknowledged(job.prepared.events, answer.duplicates if answer is not None else 0)
        if self._hand_over is not None and answer is not None:
            for command in answer.commands:
                self._hand_over(command)

    def _rejected(self, job: Job, result: SendResult) -> None:
        """A batch the ledger refuses for good: dropped, counted, reported by a marker."""
        prepared = job.prepared
        with self._counters.lock:
            if job.abandoned:
                return
            job.result = result
        self._record_drop("rejected", prepared.events, not prepared.markers_only)
