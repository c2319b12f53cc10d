"""One HTTP exchange carried through Ray: the front packs a request, a replica runs it through its ASGI app.

The replica's app is the single-process server unchanged, so a request gets exactly the handling it gets
there. Its ASGI ``send`` messages travel back one by one as :class:`Part` items of a streaming handle call,
which keeps SSE streams streaming. Cancelling the call (the client went away) shows the app an
``http.disconnect``, which aborts the engine request the same way a closed socket does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

log = logging.getLogger("specserve.rayserve")

# Messages the app may send before the caller reads them: beyond this, the app's send waits, so a slow reader
# stalls the stream (and the server's stalled-reader cutoff applies) instead of growing a buffer.
SEND_BUFFER = 64
_background: set[asyncio.Task[None]] = set()


@dataclass
class HTTPCall:
    """A request as the front received it, plus what routing needs."""

    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    client: tuple[str, int] | None = None
    block_hashes: list[int] = field(default_factory=list)
    """Prefix-cache block hashes of the prompt (64-bit), deepest last; empty: no affinity."""
    pin: str | None = None
    """A replica id: this call must run there (admin broadcast, metrics collection)."""


@dataclass
class Part:
    """One piece of the response: the start (status and headers) or a body chunk."""

    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    start: bool = False
    more: bool = True


async def run_asgi(
    app: ASGIApp, call: HTTPCall, extra_headers: list[tuple[bytes, bytes]]
) -> AsyncGenerator[Part, None]:
    """Run ``call`` through ``app``; yields the start, then body chunks (the last has ``more=False``)."""
    scope: dict[str, Any] = {
        "type": "http",
        # 2.3: Starlette then watches receive() for http.disconnect while it streams (see module docstring).
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query,
        "root_path": "",
        "headers": call.headers,
        "client": call.client,
        "server": ("ray-serve", 0),
        "state": {},
    }
    sent: asyncio.Queue[Message | None] = asyncio.Queue(SEND_BUFFER)
    disconnected = asyncio.Event()
    body_taken = False

    async def receive() -> Message:
        nonlocal body_taken
        if not body_taken:
            body_taken = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if not disconnected.is_set():  # nobody reads any more: drop
            await sent.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
        except Exception:  # the app answers its own errors; this is a bug, logged where it happened
            log.exception("the application failed on %s %s", call.method, call.path)
        finally:
            if not disconnected.is_set():
                await sent.put(None)

    task = asyncio.create_task(run())
    _background.add(task)
    task.add_done_callback(_background.discard)
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
                yield Part(status=message["status"], headers=headers + extra_headers, start=True)
            elif message["type"] == "http.response.body":
                # Body messages already waiting travel as one part: each part is a Ray object and two
                # hops (replica -> front -> proxy), which costs milliseconds; under load several SSE
                # events queue up between two reads, and this keeps the cost per read, not per event.
                chunks = [bytes(message.get("body", b""))]
                more = bool(message.get("more_body", False))
                ended = False
                while more and not sent.empty():
                    queued = sent.get_nowait()
                    if queued is None:
                        ended = True
                        break
                    if queued["type"] == "http.response.body":
                        chunks.append(bytes(queued.get("body", b"")))
                        more = bool(queued.get("more_body", False))
                yield Part(body=b"".join(chunks), more=more)
                if not more:
                    return
                if ended:
                    break
        raise RuntimeError(f"the application ended {call.method} {call.path} without a response")
    finally:
        # The response is complete, or the caller went away: either way the app sees the client leave.
        disconnected.set()
        while not sent.empty():  # unblock an app waiting to send into a full buffer
            sent.get_nowait()
