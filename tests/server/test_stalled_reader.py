"""A streaming client that stops reading is cut off after the stall timeout and its request released."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

from starlette.types import Message

from specserve.server.streaming import EventStreamResponse


def test_a_client_that_reads_nothing_is_cut_off_regression_slow_reader() -> None:
    released = asyncio.Event()
    sent: list[Message] = []

    async def events() -> AsyncGenerator[bytes, None]:
        while True:  # a request that would stream for a long time
            yield b"data: {}\n\n"
            await asyncio.sleep(0)

    async def release() -> None:
        released.set()

    async def send(message: Message) -> None:
        sent.append(message)
        if len(sent) > 3:  # the socket buffers are full: the transport never drains again
            await asyncio.Event().wait()

    async def receive() -> Message:
        await asyncio.Event().wait()  # the client never disconnects either
        raise AssertionError

    async def run() -> None:
        response = EventStreamResponse(events(), release, stall_timeout=0.2)
        scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/"}
        await asyncio.wait_for(response(scope, receive, send), 10)

    asyncio.run(run())
    assert released.is_set() and len(sent) == 4
