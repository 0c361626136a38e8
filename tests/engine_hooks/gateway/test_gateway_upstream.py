"""The upstream transport (``engine_hooks/gateway/upstream.py``) against a scripted raw HTTP/1.1 server:
framing, body pieces per socket read, keep-alive reuse and its limits, protocol errors, timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from engine_hooks.gateway.upstream import BODY_COMPLETE, upstream_transport

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUTS = {"connect": 2.0, "read": 2.0, "write": 2.0, "pool": 2.0}


class RawServer:
    """An asyncio TCP server that answers each request on a connection with the next script."""

    def __init__(self, *scripts: Script):
        self.scripts = list(scripts)
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def closed(self, count: int, timeout: float = 2.0) -> bool:
        """Wait until the client has closed ``count`` connections."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.closed_by_client < count and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        return self.closed_by_client == count

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.scripts:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client += 1
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                self.requests.append(head + await reader.readexactly(length))
                try:
                    await self.scripts.pop(0)(reader, writer)
                except ConnectionError:
                    self.closed_by_client += 1
                    return
                if writer.is_closing():
                    return
            if not await reader.read():  # wait for the client to close
                self.closed_by_client += 1
        finally:
            writer.close()


def answer(*writes: bytes, close: bool = False, pause: float = 0.0) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for data in writes:
            writer.write(data)
            await writer.drain()
            if pause:
                await asyncio.sleep(pause)
        if close:
            writer.close()

    return script


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"i":%d}\n\n' % i for i in range(3)]


async def post(
    transport: httpx.AsyncHTTPTransport, url: str, body: bytes = b"{}", method: str = "POST", **headers: str
) -> tuple[httpx.Response, list[bytes]]:
    """Send one request; read the whole body, keeping the pieces as the transport yielded them."""
    request = httpx.Request(
        method, url + "/v1/completions", content=body, headers=headers, extensions={"timeout": TIMEOUTS}
    )
    response = await transport.handle_async_request(request)
    try:
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        pieces = [piece async for piece in stream]
    finally:
        await response.aclose()
    return response, pieces


def transport_for(url: str) -> httpx.AsyncHTTPTransport:
    return upstream_transport(url, httpx.Limits(max_connections=4, max_keepalive_connections=4))


def test_a_chunked_stream_comes_as_one_piece_per_read_and_connections_are_reused():
    async def main() -> None:
        together = b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n"
        script = answer(SSE_HEAD, together, pause=0.05)  # headers first, then the events in one write
        async with RawServer(script, script) as server:
            transport = transport_for(server.url)
            for _ in range(2):
                response, pieces = await post(transport, server.url, b'{"a":1}')
                assert response.status_code == 200
                assert response.headers["content-type"] == "text/event-stream"
                assert pieces == [b"".join(EVENTS)]  # written together, read together: one piece
            await transport.aclose()
        assert server.connections == 1  # kept alive and reused
        request = server.requests[0]
        assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
        assert b"\r\ncontent-length: 7\r\n" in request.lower() and request.endswith(b'\r\n\r\n{"a":1}')

    asyncio.run(main())


def test_events_that_arrive_apart_come_apart_as_they_arrive():
    async def main() -> None:
        script = answer(
            SSE_HEAD + chunk(EVENTS[0]), chunk(EVENTS[1])[:5], chunk(EVENTS[1])[5:], b"0\r\n\r\n", pause=0.05
        )
        async with RawServer(script) as server:
            transport = transport_for(server.url)
            _, pieces = await post(transport, server.url)
            await transport.aclose()
        assert b"".join(pieces) == EVENTS[0] + EVENTS[1]
        assert pieces[0] == EVENTS[0]  # not held back until more arrived

    asyncio.run(main())


def test_the_response_says_when_its_body_has_been_read_to_the_end():
    async def main() -> None:
        script = answer(SSE_HEAD + chunk(EVENTS[0]), chunk(EVENTS[1]) + b"0\r\n\r\n", pause=0.05)
        async with RawServer(script) as server:
            transport = transport_for(server.url)
            request = httpx.Request(
                "POST", server.url + "/v1/completions", content=b"{}", extensions={"timeout": TIMEOUTS}
            )
            response = await transport.handle_async_request(request)
            complete = response.extensions[BODY_COMPLETE]
            stream = response.stream
            assert isinstance(stream, httpx.AsyncByteStream)
            seen = []
            async for piece in stream:
                seen.append((piece, complete()))
            await response.aclose()
            await transport.aclose()
        assert seen == [(EVENTS[0], False), (EVENTS[1], True)]  # known with the last piece

    asyncio.run(main())


def test_content_length_close_delimited_and_connection_close_bodies():
    async def main() -> None:
        async with RawServer(
            answer(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"),
            answer(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"),
        ) as server:
            transport = transport_for(server.url)
            assert b"".join((await post(transport, server.url))[1]) == b"hello"
            assert b"".join((await post(transport, server.url))[1]) == b"ok"
            assert await server.closed(1)  # closed after the answer, as the upstream asked
            await transport.aclose()
        assert server.connections == 1
        async with RawServer(answer(b"HTTP/1.0 200 OK\r\n\r\nuntil the end", close=True)) as server:
            transport = transport_for(server.url)
            assert b"".join((await post(transport, server.url))[1]) == b"until the end"
            assert not transport._pool.connections  # type: ignore[attr-defined]
            await transport.aclose()

    asyncio.run(main())


def test_a_response_closed_before_its_end_closes_the_connection():
    async def main() -> None:
        body = SSE_HEAD + chunk(EVENTS[0])
        rest = chunk(EVENTS[1]) + b"0\r\n\r\n"

        async def unfinished(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(body)
            await reader.read()  # the client leaves before the rest
            raise ConnectionResetError

        async with RawServer(unfinished, answer(body + rest)) as server:
            transport = transport_for(server.url)
            request = httpx.Request(
                "POST", server.url + "/v1/completions", content=b"{}", extensions={"timeout": TIMEOUTS}
            )
            response = await transport.handle_async_request(request)
            stream = response.stream
            assert isinstance(stream, httpx.AsyncByteStream)
            async for piece in stream:
                assert piece == EVENTS[0]
                break
            await response.aclose()  # the client went away: the upstream must see its connection close
            assert await server.closed(1)
            _, pieces = await post(transport, server.url)
            assert b"".join(pieces) == EVENTS[0] + EVENTS[1]
            await transport.aclose()
        assert server.connections == 2

    asyncio.run(main())


def test_100_continue_is_skipped_and_head_does_not_wait_for_a_body():
    async def main() -> None:
        async with RawServer(
            answer(b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok"),
            answer(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n"),
        ) as server:
            transport = transport_for(server.url)
            response, pieces = await post(transport, server.url)
            assert response.status_code == 201 and pieces == [b"ok"]
            response, pieces = await post(transport, server.url, b"", method="HEAD")
            assert response.status_code == 200 and pieces == []
            await transport.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("script", "error"),
    [
        (answer(b"", close=True), httpx.RemoteProtocolError),  # closed without an answer
        (answer(SSE_HEAD + chunk(EVENTS[0]), close=True), httpx.RemoteProtocolError),  # closed mid-body
        (answer(b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"), httpx.RemoteProtocolError),  # malformed
        (answer(SSE_HEAD + chunk(EVENTS[0]), pause=5), httpx.ReadTimeout),  # silent mid-body
    ],
)
def test_upstream_faults_raise_httpx_errors(script, error):
    async def main() -> None:
        async with RawServer(script) as server:
            transport = transport_for(server.url)
            with pytest.raises(error):
                await post(transport, server.url)
            await transport.aclose()

    asyncio.run(main())


def test_a_header_that_would_split_the_request_head_is_refused():
    async def main() -> None:
        async with RawServer() as server:
            transport = transport_for(server.url)
            request = httpx.Request(
                "POST",
                server.url + "/v1/completions",
                content=b"{}",
                headers=[(b"x-a", b"1\r\nx-injected: 2")],
                extensions={"timeout": TIMEOUTS},
            )
            with pytest.raises(httpx.LocalProtocolError):
                await transport.handle_async_request(request)
            await transport.aclose()
        assert server.requests == []

    asyncio.run(main())
