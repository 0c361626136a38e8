"""The exporter's JetStream transport: batches published to the stream the ledger workers consume, and
the source's commands taken from its commands subject (the contract: ``engine_hooks.streams``).

Used when ``nats_url`` is set. The NATS client is asyncio: one thread of its own runs its event loop
(``Link``), and the senders' threads wait on it for each publish's acknowledgement. A batch is
acknowledged once JetStream has stored it (``PubAck``), which is what makes it durable here; a publish
that fails or times out is retried and then spooled, as a failed POST is (``transport.Outcome``), so
NATS being down costs the engine nothing but spool writes. What a worker does with a stored batch does
not come back: a batch the ledger can never store is terminated there (logged and counted by the
worker), not answered to the source.

The stream's partitions are read from the stream itself (its description) before the first publish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from engine_hooks import streams
from engine_hooks.columnar import MEDIA_TYPE, is_message
from engine_hooks.config import ConfigError, ExporterConfig
from engine_hooks.events import PRODUCER_HEADER, Command, CommandsResponse
from engine_hooks.exporter.logonce import LogOnce
from engine_hooks.exporter.stats import Counters
from engine_hooks.exporter.transport import FAILED, Outcome, Sender, SendResult

_commands_decoder = msgspec.json.Decoder(CommandsResponse)


class Link:
    """One NATS connection on an event loop of its own thread; connects lazily, reconnects forever."""

    def __init__(self, config: ExporterConfig, log: LogOnce, name: str) -> None:
        self._config = config
        self._log = log
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"chunkledger-nats-{name}", daemon=True
        )
        self._thread.start()
        self._nc: Any = None
        self._js: Any = None
        self.partitions: int | None = None
        self.max_payload = 1 << 20
        self._subscriptions: list[tuple[str, Callable[[bytes], None]]] = []

    def run(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the link's loop and wait for it (``TimeoutError`` past ``timeout``)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"no answer from NATS within {timeout:g} s") from None

    async def _connected(self) -> Any:
        """The JetStream context, connected and the stream's partitions known."""
        if self._nc is None or self._nc.is_closed:
            import nats

            assert self._config.nats_url is not None
            self._nc = await nats.connect(
                [u.strip() for u in self._config.nats_url.split(",")],
                name=f"chunkledger-exporter-{self._config.source_id}",
                connect_timeout=self._config.connect_timeout_s,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                allow_reconnect=True,
            )
            self._js = self._nc.jetstream(timeout=self._config.timeout_s)
            self.max_payload = self._nc.max_payload
            for subject, callback in self._subscriptions:
                await self._subscribe(subject, callback)
        if self.partitions is None:
            info = await self._js.stream_info(self._config.nats_stream)
            n = streams.partitions_of(info.config.description)
            if n is None:
                raise RuntimeError(f"stream {self._config.nats_stream!r} names no partitions")
            self.partitions = n
        return self._js

    async def publish(self, subject_of: Callable[[int], str], body: bytes, headers: dict[str, str]) -> Any:
        js = await self._connected()
        assert self.partitions is not None
        return await js.publish(subject_of(self.partitions), body, headers=headers)

    async def _subscribe(self, subject: str, callback: Callable[[bytes], None]) -> None:
        async def on_message(msg: Any) -> None:
            callback(msg.data)

        await self._nc.subscribe(subject, cb=on_message)

    def subscribe(self, subject: str, callback: Callable[[bytes], None]) -> None:
        """Call ``callback`` (on the link's thread) with each message on ``subject``: now if connected,
        else from the connection the next publish makes (the client re-subscribes on reconnecting)."""

        async def start() -> None:
            self._subscriptions.append((subject, callback))
            if self._nc is not None and not self._nc.is_closed:
                await self._subscribe(subject, callback)
            else:
                with contextlib.suppress(Exception):
                    await self._connected()  # subscribes every subject listed

        asyncio.run_coroutine_threadsafe(start(), self._loop)

    def close(self, timeout: float = 2.0) -> None:
        """Drain the connection (what was published is flushed), end the client's tasks, close the loop."""

        async def shutdown() -> None:
            if self._nc is not None and not self._nc.is_closed:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._nc.drain(), timeout)
                with contextlib.suppress(Exception):
                    await self._nc.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(shutdown(), timeout + 1.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()


class JetStreamTransport(Sender):
    """Publishes encoded batches to the stream (see the module docstring); the senders' interface."""

    def __init__(
        self, config: ExporterConfig, counters: Counters, log: LogOnce, *, producer_key: str | None = None
    ) -> None:
        if importlib.util.find_spec("nats") is None:
            raise ConfigError("nats_url is set but nats-py is not installed: pip install 'chunkledger[nats]'")
        self._config = config
        self._counters = counters
        self._log = log
        self._source_id = config.source_id
        self._headers = {PRODUCER_HEADER: producer_key} if producer_key else {}
        self.link = Link(config, log, config.source_id)

    def post(self, body: bytes, records: int = 1) -> SendResult:
        counters = self._counters
        with counters.lock:
            counters.attempts += 1
        if len(body) > self.link.max_payload:
            return self._too_large(body, records)
        headers = {
            **self._headers,
            streams.MSG_ID: streams.message_id(self._source_id, body),
            streams.CONTENT_TYPE: MEDIA_TYPE if is_message(body) else "application/json",
        }
        stream = self._config.nats_stream
        try:
            self.link.run(
                self.link.publish(
                    lambda partitions: streams.events_subject(stream, self._source_id, partitions),
                    body,
                    headers,
                ),
                self._config.timeout_s + self._config.connect_timeout_s,
            )
        except Exception as exc:  # every failure to store it: a retry, then the spool
            with counters.lock:
                counters.send_failures += 1
            self._log(
                logging.WARNING,
                f"publish:{type(exc).__name__}",
                "chunkledger exporter: JetStream at %s did not store a batch (%s: %s); retrying, then "
                "spooling",
                self._config.nats_url,
                type(exc).__name__,
                exc,
            )
            return FAILED
        return SendResult(Outcome.ACKED)

    def _too_large(self, body: bytes, records: int) -> SendResult:
        if records > 1:  # a merged replay: its records one by one
            return SendResult(Outcome.SPLIT)
        self._log(
            logging.ERROR,
            "too_large",
            "chunkledger exporter: a batch of %d bytes is over the NATS server's max_payload (%d); dropping "
            "it (lower batch_size, or raise max_payload)",
            len(body),
            self.link.max_payload,
        )
        return SendResult(Outcome.REJECTED)

    def subscribe_commands(self, deliver: Callable[[Command], None]) -> None:
        """Hand each command the ledger workers publish for this source to ``deliver``."""

        def on_commands(data: bytes) -> None:
            try:
                answer = _commands_decoder.decode(data)
            except msgspec.DecodeError as exc:
                self._log(logging.WARNING, "commands", "chunkledger exporter: unreadable commands: %s", exc)
                return
            for command in answer.commands:
                deliver(command)

        self.link.subscribe(streams.commands_subject(self._config.nats_stream, self._source_id), on_commands)

    def close(self) -> None:
        self.link.close()
