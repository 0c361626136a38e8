"""A header timeout for uvicorn, shared by the two HTTP servers (the ledger's and the gateway's).

uvicorn has a keep-alive timeout for an idle connection between requests, but nothing for a connection
that opens and sends nothing, or trickles its request head a byte at a time: thousands of such sockets
are held for as long as the clients like. :func:`header_timeout_protocol` gives uvicorn's HTTP protocol
a timer that closes the connection unless a whole request head (request line and headers) arrives within
``timeout_s`` of the connection opening, or of the previous answer on a kept-alive connection. (The
body has its own deadline, in each app.)
"""

from __future__ import annotations

import asyncio
from typing import Any


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with the header timeout;
    pass it as ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None

        def _start_head_timer(self) -> None:
            self._head_cycle = self.cycle
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._start_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._start_head_timer()  # the next request's head starts on a kept-alive connection
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._head_cycle:
                self._stop_head_timer()  # the head is complete: the request is the app's now

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
