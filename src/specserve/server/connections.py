"""Connection limits uvicorn does not have: a deadline for request headers, and a cap on open connections.

uvicorn times out only idle keep-alive connections. A client that opens a connection and sends its headers
a byte at a time (slowloris), or never finishes them, holds the connection and its memory forever: 300 such
connections were all still open after 60 s. So every connection gets ``header_timeout`` seconds from its
start (and from the end of each response, for the next request on a kept-alive connection) to deliver
complete request headers, and connections past ``max_connections`` are closed as soon as they open.
uvicorn's ``limit_concurrency`` still answers 503 to requests past the same limit.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("specserve.server")


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (see :func:`bounded_protocol`)"""

    header_timeout: float = 10.0
    max_connections: int = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("refused a connection: %d open (max_connections)", len(self.connections) - 1)
            transport.abort()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request line and headers are complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE or self.conn.their_state is h11.DONE:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        # Nothing useful can be said to a client that is still sending headers: close, as nginx does (408
        # is optional there and would be read by no one).
        self.transport.close()


def bounded_protocol(header_timeout: float, max_connections: int) -> type[BoundedH11Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type(
        "SpecserveH11Protocol",
        (BoundedH11Protocol,),
        {"header_timeout": header_timeout, "max_connections": max_connections},
    )
