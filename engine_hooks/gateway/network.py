"""An httpcore network backend on plain asyncio streams, for the gateway's upstream connections.

httpx's default transport runs httpcore over anyio, which opens a cancel scope around every socket
read and write. This backend uses asyncio streams directly and also coalesces writes: what httpcore
writes (request headers, then the body) is held until it next reads, and goes out in one ``send``,
so the upstream gets one segment and wakes once per request. HTTP/1.1 only needs that: a client
writes the whole request before it reads the response.

Plain TCP only (``http://`` upstreams); the gateway keeps httpx's default backend for ``https://``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from typing import Any

import httpcore

_FLUSH_BYTES = 1 << 16  # write out before the next read at the latest, or once this much is held


class AsyncioStream(httpcore.AsyncNetworkStream):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer
        self._held: list[bytes] = []
        self._held_bytes = 0

    async def _flush(self, timeout: float | None) -> None:
        data = b"".join(self._held) if len(self._held) > 1 else self._held[0]
        self._held.clear()
        self._held_bytes = 0
        try:
            self._writer.write(data)
            if self._writer.transport.get_write_buffer_size() > _FLUSH_BYTES:
                async with asyncio.timeout(timeout):
                    await self._writer.drain()
        except TimeoutError:
            raise httpcore.WriteTimeout(f"no progress writing to the upstream for {timeout} s") from None
        except (OSError, RuntimeError) as exc:
            raise httpcore.WriteError(str(exc) or type(exc).__name__) from None

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            await self._flush(timeout)
        try:
            if timeout is None:
                return await self._reader.read(max_bytes)
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout(f"the upstream sent nothing for {timeout} s") from None
        except OSError as exc:
            raise httpcore.ReadError(str(exc) or type(exc).__name__) from None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        self._held.append(buffer)
        self._held_bytes += len(buffer)
        if self._held_bytes >= _FLUSH_BYTES:
            await self._flush(timeout)

    async def aclose(self) -> None:
        self._held.clear()
        self._writer.close()

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # httpcore asks before reusing an idle pooled connection
            return (
                self._reader.at_eof()
                or self._writer.is_closing()
                or bool(getattr(self._reader, "_buffer", b""))
            )
        if info == "socket":
            return self._writer.get_extra_info("socket")
        if info == "client_addr":
            return self._writer.get_extra_info("sockname")
        if info == "server_addr":
            return self._writer.get_extra_info("peername")
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, local_addr=(local_address, 0) if local_address else None, limit=1 << 20
                )
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connecting to {host}:{port} took over {timeout} s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc) or type(exc).__name__) from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path, limit=1 << 20)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connecting to {path} took over {timeout} s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc) or type(exc).__name__) from None
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
