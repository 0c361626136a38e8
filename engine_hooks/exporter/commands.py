"""Commands from the ledger (cutoffs, pool moves): one de-duplicator and one long-poller.

Commands reach a source two ways: on the answers to its ingest POSTs, and by long-polling
``GET /v1/commands`` on a connection of its own. An ingest answer comes only after the ledger has
stored the batch, so when its commits slow down, or when nothing is emitted (a gateway relaying a long
stream), the poll still brings a cutoff within milliseconds of the decision. The ledger sends a command
again until it is confirmed, so both paths go through one ``CommandDeduper`` that hands each command id
to the host once. The exporter (and through it the gateway) uses both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import httpx
import msgspec

from engine_hooks.events import Command, commands_decoder
from engine_hooks.exporter.logonce import LogOnce
from engine_hooks.exporter.transport import request_headers

CommandCallback = Callable[[Command], None]

COMMAND_MEMORY = 4096  # command ids remembered to hand each command to the host once


class CommandDeduper:
    """Calls ``callback`` once per command id, never concurrently (any thread may call it).

    A command whose callback raises is not remembered: the ledger re-sends it until it is confirmed.
    """

    def __init__(self, callback: CommandCallback, log: LogOnce, memory: int = COMMAND_MEMORY):
        self._callback = callback
        self._log = log
        self._memory = memory
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # senders and the poller hand commands over
        self.handed = 0  # commands handed to the callback

    def __call__(self, command: Command) -> None:
        with self._lock:
            if command.id in self._seen:
                return
            try:
                self._callback(command)
            except Exception:
                self._log(
                    logging.ERROR,
                    "on_command",
                    "chunkledger exporter: on_command callback failed",
                    exc_info=True,
                )
                return  # not remembered: the ledger re-sends it until it is confirmed
            self.handed += 1
            self._seen[command.id] = None
            if len(self._seen) > self._memory:
                self._seen.popitem(last=False)


class CommandPoller:
    """Long-polls ``GET {url}/v1/commands`` for one source on a thread of its own until ``stop`` is set.

    Each command goes to ``deliver``. A ledger without the endpoint (404) is asked again after 30 s;
    other failures back off from 0.5 s to 10 s; a ledger that answers at once without commands (it does
    not hold the poll) is asked again after 1 s. ``close()`` ends a poll the ledger is holding.
    """

    def __init__(
        self,
        *,
        url: str,
        source_id: str,
        wait_s: float,
        token: str | None,
        connect_timeout_s: float,
        producer_key: str | None = None,
        deliver: Callable[[Command], None],
        stop: threading.Event,
        log: LogOnce,
    ):
        self.url = url.rstrip("/") + "/v1/commands"
        self._source_id = source_id
        self._wait_s = wait_s
        self._deliver = deliver
        self._stop = stop
        self._log = log
        self._client = httpx.Client(
            headers=request_headers(token, producer_key),
            timeout=httpx.Timeout(wait_s + 10.0, connect=connect_timeout_s),
            trust_env=False,
        )
        self._thread = threading.Thread(
            target=self._run, name=f"chunkledger-commands-{source_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Close the connection (from any thread): ends a poll held by the ledger."""
        self._client.close()

    def _run(self) -> None:
        wait_s, url, stop = self._wait_s, self.url, self._stop
        backoff = 0.5
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    response = self._client.get(url, params={"source_id": self._source_id, "wait_s": wait_s})
                    if response.status_code == 404:  # a ledger without the endpoint: look again later
                        stop.wait(30.0)
                        continue
                    response.raise_for_status()
                    answer = commands_decoder.decode(response.content)
                except (httpx.HTTPError, msgspec.DecodeError, RuntimeError) as exc:
                    if stop.is_set():
                        return
                    self._log(
                        logging.WARNING,
                        "poll",
                        "chunkledger exporter: polling %s for commands failed: %s",
                        url,
                        exc,
                    )
                    stop.wait(backoff)
                    backoff = min(backoff * 2, 10.0)
                    continue
                backoff = 0.5
                for command in answer.commands:
                    self._deliver(command)
                if not answer.commands and time.monotonic() - started < wait_s / 2:
                    stop.wait(1.0)  # a ledger that does not hold the poll: do not spin
        finally:
            self._client.close()
