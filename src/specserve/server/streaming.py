"""One request's outputs on their way to the client: admission, SSE streaming, collection, cleanup.

A stream is ``data: <chunk>`` events: for chat, first a chunk whose delta carries the role; then one chunk
per non-empty text delta; then a chunk with an empty delta, the ``finish_reason`` and the request's
``speculative`` statistics; with ``stream_options.include_usage`` an extra chunk with no choices and the
usage; finally ``data: [DONE]``. An error after the response started (timeout, dead engine) becomes one
``data: {"error": ...}`` event followed by ``data: [DONE]``.

Disconnects: Starlette cancels the task that iterates a stream, and :class:`EventStreamResponse` then
closes the engine's output iterator in every case, which aborts the sequence; a non-streamed request
watches for the disconnect itself (:func:`collect`) and aborts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import RequestOutput
from specserve.sequence import Sequence
from specserve.server import protocol as p
from specserve.server.errors import from_engine_error, internal_error
from specserve.server.middleware import note_stream_error

log = logging.getLogger("specserve.server")

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any], ascii_only: bool = False) -> bytes:
    text = json.dumps(payload, ensure_ascii=ascii_only, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


@dataclass(frozen=True)
class ChunkFormat:
    """Builds one response: its stream chunks (``*.chunk`` / ``text_completion``) or its whole body."""

    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool

    def _chunk(self, choice: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, **choice, "logprobs": None, "finish_reason": finish_reason}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def opening(self) -> dict[str, Any] | None:
        return self._chunk({"delta": {"role": "assistant", "content": ""}}) if self.chat else None

    def delta(self, text: str) -> dict[str, Any]:
        return self._chunk({"delta": {"content": text}} if self.chat else {"text": text})

    def finish(self, reason: str | None, speculative: dict[str, float | int]) -> dict[str, Any]:
        chunk = self._chunk({"delta": {}} if self.chat else {"text": ""}, reason)
        chunk["speculative"] = speculative
        return chunk

    def usage(self, seq: Sequence) -> dict[str, Any]:
        chunk = self._chunk({})
        chunk["choices"] = []
        chunk["usage"] = p.Usage.of(seq).model_dump()
        return chunk

    def response(self, text: str, out: RequestOutput) -> dict[str, Any]:
        """The non-streamed response body (``chat.completion`` or ``text_completion``)."""
        seq = out.seq
        usage = p.Usage.of(seq)
        common = {"id": self.id, "created": self.created, "model": self.model}
        response: p.CompletionResponse | p.ChatCompletionResponse
        if self.chat:
            choice = p.ChatChoice(message=p.AssistantMessage(content=text), finish_reason=seq.finish_reason)
            response = p.ChatCompletionResponse.model_validate(
                {**common, "choices": [choice], "usage": usage, "speculative": seq.stats.as_dict()}
            )
        else:
            choices = [p.CompletionChoice(text=text, finish_reason=seq.finish_reason)]
            response = p.CompletionResponse.model_validate(
                {**common, "choices": choices, "usage": usage, "speculative": seq.stats.as_dict()}
            )
        return response.model_dump()


KEEPALIVE = b": waiting\n\n"  # an SSE comment: clients ignore it, connections see traffic


async def stream_events(
    first: asyncio.Task[RequestOutput],
    outputs: AsyncIterator[RequestOutput],
    fmt: ChunkFormat,
    keepalive: float = 5.0,
) -> AsyncGenerator[bytes, None]:
    """The SSE body: ``first`` is the request's first output (already admitted), ``outputs`` the rest.

    Until the first output arrives (waiting for a slot, then the prompt's prefill) an SSE comment every
    ``keepalive`` seconds keeps clients and proxies with idle timeouts from dropping the request."""
    try:
        opening = fmt.opening()
        if opening is not None:
            yield sse(opening)
        while not (await asyncio.wait({first}, timeout=keepalive))[0]:
            yield KEEPALIVE
        out = first.result()
        while True:
            if out.text_delta:
                yield sse(fmt.delta(out.text_delta))
            if out.finished:
                break
            out = await anext(outputs)
        seq = out.seq
        yield sse(fmt.finish(seq.finish_reason, seq.stats.as_dict()))
        if fmt.include_usage:
            yield sse(fmt.usage(seq))
    except Exception as exc:
        error = from_engine_error(exc)
        if error is None:
            log.error("error while streaming %s", fmt.id, exc_info=exc)
            error = internal_error()
        note_stream_error(error)
        yield sse(error.body(), ascii_only=True)
    yield DONE


class _StalledClient(Exception):
    """The client read nothing for the stall timeout."""


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that always releases the engine request when it ends.

    Starlette cancels the stream on disconnect but never closes the body iterator; a generator that was
    suspended at a ``yield`` (or never started) would keep its request running. ``release`` fixes that.

    A client that stops reading stalls ``send`` once the socket buffers are full; after ``stall_timeout``
    seconds of that the stream is given up (and its request aborted), so a slow reader holds neither a
    slot nor a growing buffer until the request timeout.
    """

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        release: Callable[[], Awaitable[None]],
        stall_timeout: float = 30.0,
    ) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._release = release
        self._stall_timeout = stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def bounded_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self._stall_timeout)
            except TimeoutError:
                log.warning(
                    "a streaming client read nothing for %g s; its request is cancelled", self._stall_timeout
                )
                raise _StalledClient from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except _StalledClient:
            pass  # nothing more can be sent to it; the request is released below
        finally:
            await self._events.aclose()
            await self._release()


async def release_request(
    first: asyncio.Task[RequestOutput], outputs: AsyncGenerator[RequestOutput, None]
) -> None:
    """Stop a request's output stream: AsyncEngine aborts the sequence if it has not finished.

    Idempotent. Either the first output is still awaited in its own task (cancel it) or the generator is
    suspended between items (close it); both run ``AsyncEngine.generate``'s abort-on-exit.
    """
    if not first.done():
        first.cancel()
        return
    if not first.cancelled():
        first.exception()  # retrieved: no "exception was never retrieved" warning
    await outputs.aclose()


async def admit(outputs: AsyncIterator[RequestOutput]) -> asyncio.Task[RequestOutput]:
    """Start the request and wait for its first output in a task; admission errors raise here.

    ``AsyncEngine.generate`` admits (or refuses with QueueFullError) before its first ``await``, so after one
    turn of the event loop the task has either failed or passed admission: errors then still get a status.
    """

    async def first() -> RequestOutput:
        return await anext(outputs)

    task = asyncio.create_task(first())
    try:
        await asyncio.sleep(0)
    except BaseException:  # the handler was cancelled: the request must not run unobserved
        task.cancel()
        raise
    if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
        raise from_engine_error(exc) or exc
    return task


async def abort_on_disconnect(request: Request, engine: AsyncEngine, request_id: str) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.abort(request_id)  # the request's consumer receives a final output and returns


async def collect(
    request: Request,
    engine: AsyncEngine,
    request_id: str,
    first: asyncio.Task[RequestOutput],
    outputs: AsyncGenerator[RequestOutput, None],
) -> tuple[str, RequestOutput]:
    """The whole text of a non-streamed request; a client that disconnects aborts it."""
    watcher = asyncio.create_task(abort_on_disconnect(request, engine, request_id))
    try:
        out = await first
        parts = [out.text_delta]
        while not out.finished:
            out = await anext(outputs)
            parts.append(out.text_delta)
        return "".join(parts), out
    except Exception as exc:
        error = from_engine_error(exc)
        if error is None:
            raise
        raise error from None
    finally:
        watcher.cancel()
        await release_request(first, outputs)
