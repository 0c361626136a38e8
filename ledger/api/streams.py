"""A streamed answer made by a blocking iterator, whose every step and whose end run on worker threads.

Starlette's ``StreamingResponse`` over a plain generator does not close the generator when the stream
ends early (a client that disconnects, or one the gate abandons at ``send_timeout_s``): the database
connection and transaction the generator holds stay open until the garbage collector gets to it. Here
the generator is closed, on a worker thread, however the stream ends, so a Parquet export releases its
connection the moment its client is gone or stops reading.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator, Mapping
from typing import Any

import anyio
from starlette.responses import Response

from ledger.reads import read_priority


def _next(chunks: Generator[bytes, None, None], nice: int) -> bytes | None:
    read_priority(nice)  # a stream is a read: whichever worker thread makes its next part runs nicer
    return next(chunks, None)


class ThreadedStream(Response):
    def __init__(
        self,
        chunks: Generator[bytes, None, None],
        *,
        media_type: str,
        headers: Mapping[str, str] | None = None,
        nice: int = 0,
    ) -> None:
        self.chunks = chunks
        self.nice = nice
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            while not gone.is_set():
                chunk = await anyio.to_thread.run_sync(_next, self.chunks, self.nice)
                if chunk is None:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    break
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            # shielded: a cancelled stream still releases what its generator holds
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.chunks.close)
