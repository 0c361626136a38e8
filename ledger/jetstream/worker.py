"""A ledger as a worker of the JetStream stream: it consumes its share of the partitions, stores and
rules their batches as ``POST /v1/events`` would, and sends the commands of its sources back.

The stream and its subjects: ``engine_hooks.streams``. Which partitions: ``ledger.jetstream.leases``.

**One partition, one consumer.** Each partition has a durable pull consumer (``part-<n>``) filtered on
its subjects. A worker that takes a partition makes its consumer anew, starting after the consumer's
acknowledgement floor, so whatever the previous owner took and did not acknowledge (it died mid-commit)
is delivered again at once, not after ``ack_wait``; the store's idempotence (source, seq) makes a batch
stored twice count once. It then takes up to ``nats_fetch`` messages at a time and submits them
together, so they go into one group commit, and acknowledges each once its commit is done: a message
is acknowledged only after what it carried is durable. A batch that can never be stored (it fails the
contract's checks) is terminated, logged and counted, not re-delivered; a writer that is shutting down
gets a negative acknowledgement and the message goes to the next owner.

**Commands.** The rules decide on the batches a worker consumes, so the commands of a request go out
from the worker that holds its engine's partition (a command's home source: ``home_source``). It
publishes each source's pending commands on the source's commands subject when they are new and again
every ``RESEND_S`` until the source confirms, which it does in a batch that comes back to the same
worker. A target in another worker's partitions (the request's gateway) confirms there; the home
worker sees it in the store (``CommandBook.refresh``) and stops re-sending. On taking a partition a
worker loads the pending commands whose home is in it; on handing one on it forgets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec

from engine_hooks import events as ev
from engine_hooks import streams
from ledger import intake
from ledger.config import Settings
from ledger.ingest import WriterUnavailable
from ledger.jetstream.leases import Change, Leases
from ledger.producers import digest
from ledger.validation import BadBatch

log = logging.getLogger(__name__)

RESEND_S = 1.0  # pending commands are published again this often until confirmed
REFRESH_S = 1.0  # how often the command book catches up with confirmations other workers stored
_commands_encoder = msgspec.json.Encoder()


class StreamWorker:
    """Runs on the app's event loop (``start``/``stop`` from its lifespan); ``state`` is the app's."""

    def __init__(self, settings: Settings, state: Any) -> None:
        self.settings = settings
        self.state = state
        self.stream = settings.nats_stream
        self.partitions = settings.nats_partitions
        self._nc: Any = None
        self._js: Any = None
        self.leases: Leases | None = None
        self._consumers: dict[int, tuple[asyncio.Task[None], asyncio.Event]] = {}  # partition -> (task, stop)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self._sent: dict[str, tuple[frozenset[str], float]] = {}  # source -> (command ids, when sent)
        self.taken = 0  # messages stored and acknowledged
        self.terminated = 0  # messages that can never be stored

    # -- life ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        try:
            import nats
        except ImportError:
            raise RuntimeError(
                "nats_url is set but nats-py is not installed: pip install 'chunkledger[nats]'"
            ) from None

        self._loop = asyncio.get_running_loop()
        if self.state.store.dialect != "postgresql":
            raise RuntimeError(
                "nats_url: stream workers share one PostgreSQL database (db_url postgresql://...); "
                f"this ledger's is {self.state.store.dialect}"
            )
        self._nc = await nats.connect(
            [u.strip() for u in self.settings.nats_url.split(",")],
            name="chunkledger-worker",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
        )
        self._js = self._nc.jetstream()
        self.partitions = await self._ensure_stream()
        self.leases = await asyncio.to_thread(Leases, self._db_url(), self.stream, self.partitions)
        slot = await asyncio.to_thread(self.leases.join)
        book = self.state.runaway.book
        await asyncio.to_thread(book.forget, self.owns)  # it holds no partition yet
        log.info("stream worker %d on %s (%d partitions)", slot, self.stream, self.partitions)
        self._tasks = [
            asyncio.create_task(self._balance_loop(), name="chunkledger-balance"),
            asyncio.create_task(self._commands_loop(), name="chunkledger-stream-commands"),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self._stop_consumers(list(self._consumers))
        if self.leases is not None:
            await asyncio.to_thread(self.leases.close)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.drain()

    async def _ensure_stream(self) -> int:
        """The stream's partitions; the stream is created with ``nats_partitions`` if it is missing."""
        from nats.js.api import RetentionPolicy, StorageType, StreamConfig
        from nats.js.errors import NotFoundError

        try:
            info = await self._js.stream_info(self.stream)
        except NotFoundError:
            config = StreamConfig(
                name=self.stream,
                subjects=[streams.events_subjects(self.stream)],
                description=streams.describe(self.settings.nats_partitions),
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                max_age=self.settings.nats_max_age_s,
                num_replicas=self.settings.nats_replicas,
                duplicate_window=120.0,
            )
            with contextlib.suppress(Exception):  # another worker may create it at the same moment
                await self._js.add_stream(config)
            info = await self._js.stream_info(self.stream)
        n = streams.partitions_of(info.config.description)
        if n is None:
            raise RuntimeError(
                f"stream {self.stream!r} is not a chunkledger stream (its description names no partitions)"
            )
        return n

    def _db_url(self) -> str:
        return str(self.state.store.engine.url.render_as_string(hide_password=False))

    def owns(self, source_id: str) -> bool:
        held = self.leases.held if self.leases is not None else set()
        return streams.partition_of(source_id, self.partitions) in held

    # -- partitions ----------------------------------------------------------------------------------
    async def _balance_loop(self) -> None:
        while True:
            try:
                await self.balance()
            except asyncio.CancelledError:
                raise
            except Exception:
                # The lease connection failed: the locks may be gone with it, so stop consuming
                # everything and start over with a new connection.
                log.exception("stream worker: lost the partition leases; consuming nothing until retaken")
                await self._stop_consumers(list(self._consumers))
                await self._rejoin()
            await asyncio.sleep(self.settings.nats_balance_s)

    async def _rejoin(self) -> None:
        assert self.leases is not None
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.leases.close)
        try:
            self.leases = await asyncio.to_thread(Leases, self._db_url(), self.stream, self.partitions)
            await asyncio.to_thread(self.leases.join)
        except Exception:
            log.exception("stream worker: could not rejoin; retrying")

    async def balance(self) -> Change:
        """One step toward an even share (``Leases.balance``): consumers started for the partitions
        taken, and stopped before the partitions handed back."""
        assert self.leases is not None
        change = await asyncio.to_thread(self.leases.balance)
        if change.released:
            await self._stop_consumers(change.released)
            await asyncio.to_thread(self.leases.release, change.released)
            await asyncio.to_thread(self.state.runaway.book.forget, self.owns)
        if change.taken:
            await asyncio.to_thread(self.state.runaway.book.load, self.owns)
            for p in change.taken:
                await self._open_consumer(p)
                stop = asyncio.Event()
                task = asyncio.create_task(self._consume(p, stop), name=f"chunkledger-partition-{p}")
                self._consumers[p] = (task, stop)
            self._wake.set()
            log.info("stream worker: took partitions %s", change.taken)
        return change

    async def _open_consumer(self, p: int) -> None:
        """Make partition ``p``'s consumer anew after its acknowledgement floor (see the docstring)."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        name = f"part-{p}"
        start = None
        try:
            info = await self._js.consumer_info(self.stream, name)
            start = info.ack_floor.stream_seq + 1
            await self._js.delete_consumer(self.stream, name)
        except NotFoundError:
            pass
        config = ConsumerConfig(
            durable_name=name,
            filter_subject=streams.partition_subjects(self.stream, p),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.settings.nats_ack_wait_s,
            max_ack_pending=max(1024, 4 * self.settings.nats_fetch),
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start else DeliverPolicy.ALL,
            opt_start_seq=start,
        )
        await self._js.add_consumer(self.stream, config)

    async def _stop_consumers(self, partitions: list[int]) -> None:
        """Stop the partitions' consumers after the messages they took are stored and acknowledged (at
        most ``nats_ack_wait_s``: then they are cancelled, and the next owner takes those again)."""
        stopping = [self._consumers.pop(p) for p in partitions if p in self._consumers]
        for _, stop in stopping:
            stop.set()
        for task, _ in stopping:
            try:
                await asyncio.wait_for(task, timeout=self.settings.nats_ack_wait_s)
            except (TimeoutError, asyncio.CancelledError):
                pass
            except Exception:
                log.exception("stream worker: a partition's consumer failed")

    async def _consume(self, p: int, stop: asyncio.Event) -> None:
        """Take partition ``p``'s messages until ``stop``; a failing subscription is bound again."""
        while not stop.is_set():
            try:
                await self._consume_bound(p, stop)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("stream worker: partition %d's consumer failed; binding it again", p)
                await asyncio.sleep(0.5)

    async def _consume_bound(self, p: int, stop: asyncio.Event) -> None:
        from nats.errors import TimeoutError as FetchTimeout

        sub = await self._js.pull_subscribe_bind(f"part-{p}", stream=self.stream)
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(self.settings.nats_fetch, timeout=0.25)
                except (TimeoutError, FetchTimeout):  # nothing came: the client raises either
                    continue
                # Submitted together: one group commit; each acknowledged once it is durable.
                await asyncio.gather(*(self._take(m) for m in msgs))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _take(self, msg: Any) -> None:
        received = time.monotonic()
        headers = msg.headers or {}
        metrics = self.state.metrics
        try:
            batch, columns = intake.decode(
                msg.data, headers.get(streams.CONTENT_TYPE), self.settings.max_events_per_batch
            )
        except BadBatch as exc:
            self.terminated += 1
            metrics.ingest_rejections.labels("invalid").inc()
            log.warning(
                "stream worker: a message on %s can never be stored (%s); terminated",
                msg.subject,
                str(BadBatch(exc.errors[:3])),
            )
            await msg.term()
            return
        columns = intake.clamp_clock(batch, columns, self.settings, metrics)
        producer = digest(headers.get(ev.PRODUCER_HEADER))
        try:
            result = await intake.store(self.state, batch, columns, producer, len(msg.data), received)
        except WriterUnavailable:
            await msg.nak(delay=1.0)
            return
        # What the HTTP route answers 409 for was refused for good, the rest of the batch stored: the
        # message is done either way (counted and logged as there).
        if result.conflicts:
            metrics.ingest_rejections.labels("conflicting_replay").inc()
            log.warning("stream worker: %s replayed seqs stored with other content", batch.source.id)
        if result.foreign:
            metrics.ingest_rejections.labels("not_request_owner").inc()
            log.warning("stream worker: %s sent events about requests another source serves", batch.source.id)
        await msg.ack()
        self.taken += 1

    # -- commands ------------------------------------------------------------------------------------
    async def _commands_loop(self) -> None:
        book = self.state.runaway.book
        book.on_new = self._wake_soon  # decisions recorded on other threads wake this loop
        last_refresh = 0.0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=RESEND_S / 4)
            self._wake.clear()
            now = time.monotonic()
            if now - last_refresh >= REFRESH_S:
                last_refresh = now
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(book.refresh)
            await self.publish_commands(now)

    def _wake_soon(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def publish_commands(self, now: float) -> int:
        """Publish each source's pending commands when new, else every ``RESEND_S``; the sources sent to."""
        book = self.state.runaway.book
        sent = 0
        for sid in book.sources():
            commands = book.for_source(sid)
            if not commands:
                continue
            ids = frozenset(c.id for c in commands)
            before = self._sent.get(sid)
            if before is not None and before[0] >= ids and now - before[1] < RESEND_S:
                continue
            body = _commands_encoder.encode(ev.CommandsResponse(commands=commands))
            try:
                await self._nc.publish(streams.commands_subject(self.stream, sid), body)
            except Exception:
                log.warning("stream worker: could not publish commands for %s; retrying", sid, exc_info=True)
                continue
            self._sent[sid] = (ids, now)
            await asyncio.to_thread(book.mark_delivered, sid, commands, "stream")
            sent += 1
        for sid in [s for s in self._sent if not book.has_pending(s)]:
            del self._sent[sid]
        return sent
