"""Connection limits uvicorn does not have: a deadline for request headers, and a cap on open connections.

uvicorn times out only idle keep-alive connections. A client that opens a connection and sends its headers
a byte at a time (slowloris), or never finishes them, holds the connection and its memory forever: 300 such
connections were all still open after 60 s. So every connection gets ``header_timeout`` seconds from its
start (and from the end of each response, for the next request on a kept-alive connection) to deliver
complete request headers, and connections past ``max_connections`` are closed as soon as they open.
uvicorn's ``limit_concurrency`` still answers 503 to requests past the same limit.

The protocol is uvicorn's httptools one (llhttp, in C), not its h11 one: a streamed token's chunk costs it
a few microseconds of Python where h11's event state machine costs tens, on every token of every stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("specserve.server")


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline and a connection cap (``bounded_protocol``)."""

    header_timeout: float = 10.0
    max_connections: int = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_request = False  # a request's headers are complete and its response is not yet

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            log.warning("refused a connection: %d open (max_connections)", len(self.connections) - 1)
            transport.abort()
            return
        self._arm()

    def on_headers_complete(self) -> None:
        self._in_request = True
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self._in_request = False
        super().on_response_complete()
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
        if self._in_request or self.transport.is_closing():
            return
        # Nothing useful can be said to a client that is still sending headers: close, as nginx does (408
        # is optional there and would be read by no one).
        self.transport.close()


def bounded_protocol(header_timeout: float, max_connections: int) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    return type(
        "SpecserveHTTPProtocol",
        (BoundedHttpToolsProtocol,),
        {"header_timeout": header_timeout, "max_connections": max_connections},
    )
