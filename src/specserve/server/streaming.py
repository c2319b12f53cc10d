"""A request's outputs on their way to the client: admission, SSE streaming of its choices, collection,
cleanup.

A stream is ``data: <chunk>`` events (bodies from server/chunks.py): for chat, first a chunk per choice
whose delta carries the role; then one chunk per non-empty text delta (with its tokens' logprobs when asked)
and one per completed tool call, the ``n`` choices interleaved as their outputs come, each chunk naming its
``index``; per choice a chunk with an empty delta, the ``finish_reason`` and its ``speculative`` statistics;
with ``stream_options.include_usage`` an extra chunk with no choices and the usage; finally
``data: [DONE]``. An error after the response started (timeout, dead engine) becomes one
``data: {"error": ...}`` event followed by ``data: [DONE]``.

Disconnects: Starlette cancels the task that iterates a stream, and :class:`EventStreamResponse` then
closes the engine's output iterators in every case, which aborts the sequences; a non-streamed request
watches for the disconnect itself (:func:`collect`) and aborts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.output_processor import RequestOutput, RequestState
from specserve.server.chunks import ChunkFormat, sse
from specserve.server.errors import APIError, from_engine_error, internal_error
from specserve.server.middleware import note_stream_error
from specserve.server.tool_calls import StreamingToolParser
from specserve.server.tool_stream import GrammarToolStream, one_entry_per_call
from specserve.verify.logprobs import TokenLogprobs

log = logging.getLogger("specserve.server")

DONE = b"data: [DONE]\n\n"


KEEPALIVE = b": waiting\n\n"  # an SSE comment: clients ignore it, connections see traffic


@dataclass
class Choice:
    """One of a request's ``n`` choices: an engine request, admitted, with its first output awaited in
    ``first`` and the rest in ``outputs``."""

    index: int
    request_id: str
    first: asyncio.Task[RequestOutput]
    outputs: AsyncGenerator[RequestOutput, None]


async def _pump(choice: Choice, sink: asyncio.Queue[tuple[int, RequestOutput | BaseException]]) -> None:
    try:
        out = await choice.first
        await sink.put((choice.index, out))
        while not out.finished:
            out = await anext(choice.outputs)
            await sink.put((choice.index, out))
    except Exception as exc:
        await sink.put((choice.index, exc))


@dataclass
class _ChoiceStream:
    """What one choice's stream has sent: characters (for completions' text_offset), logprobs waiting for
    text to ride with (an incomplete character or a held-back stop string sends none), tool calls."""

    sent: int = 0
    pending: list[TokenLogprobs] = field(default_factory=list)
    parser: StreamingToolParser | GrammarToolStream | None = None
    calls: int = 0
    started: bool = False
    """Its first output came (with it, what the response shows of the prompt)."""


def _choice_events(fmt: ChunkFormat, index: int, state: _ChoiceStream, out: RequestOutput) -> list[bytes]:
    state.pending.extend(out.new_logprobs)
    text, calls = out.text_delta, list[dict[str, Any]]()
    if state.parser is not None:
        text, calls = state.parser.feed(text)
        if out.finished:
            rest, more = state.parser.finish()
            text, calls = text + rest, calls + more
    events = []
    if not state.started:
        state.started = True
        if (prompt := fmt.prompt_chunk(index, out.state)) is not None:
            events.append(sse(prompt))
    if text or (out.finished and state.pending):
        offset = len(fmt.prompt.echo(index)) + state.sent
        logprobs = fmt.output_logprobs(state.pending, offset) if state.pending else None
        events.append(sse(fmt.delta(index, text, logprobs)) if logprobs else fmt.delta_event(index, text))
        state.sent += len(text)
        state.pending = []
    if calls:
        events.append(sse(fmt.tool_delta(index, one_entry_per_call(calls))))
        state.calls += len(calls)
    if out.finished:
        reason = (
            "tool_calls" if state.calls and out.state.finish_reason == "stop" else out.state.finish_reason
        )
        events.append(sse(fmt.finish(index, reason, out.state.stats.as_dict())))
    return events


async def stream_events(
    choices: list[Choice], fmt: ChunkFormat, keepalive: float = 5.0
) -> AsyncGenerator[bytes, None]:
    """The SSE body of a request's choices (already admitted), interleaved as their outputs come.

    Until an output arrives (waiting for a slot, then the prompt's prefill) an SSE comment every
    ``keepalive`` seconds keeps clients and proxies with idle timeouts from dropping the request."""
    states = [_ChoiceStream(parser=fmt.tools.streaming() if fmt.tools else None) for _ in choices]
    requests: list[RequestState | None] = [None] * len(choices)
    items = _outputs(choices, keepalive)
    try:
        for choice in choices:
            opening = fmt.opening(choice.index)
            if opening is not None:
                yield sse(opening)
        async for item in items:
            if item is None:
                yield KEEPALIVE
                continue
            index, out = item
            events = _choice_events(fmt, index, states[index], out)
            if events:  # one send per output (none for one that shows nothing yet: a cut character)
                yield b"".join(events)
            requests[index] = out.state
        if fmt.include_usage:
            yield sse(fmt.usage([s for s in requests if s is not None]))
    except Exception as exc:
        yield sse(stream_failure(exc, fmt.id).body(), ascii_only=True)
    finally:
        await items.aclose()  # off the choices' generators before they are closed
    yield DONE


async def _outputs(
    choices: list[Choice], keepalive: float
) -> AsyncGenerator[tuple[int, RequestOutput] | None, None]:
    """Every output of every choice, as ``(index, output)`` in the order they come, until each has its
    last; ``None`` each ``keepalive`` seconds that nothing came before every choice's first output. One
    choice is read directly (no task or queue between its outputs and the stream); several through one
    queue that a task per choice fills."""
    if len(choices) == 1:
        [choice] = choices
        while not choice.first.done():
            await asyncio.wait({choice.first}, timeout=keepalive)  # a timer until the first output only
            if not choice.first.done():
                yield None
        out = choice.first.result()
        yield choice.index, out
        while not out.finished:
            out = await anext(choice.outputs)
            yield choice.index, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(c, queue)) for c in choices]
    started, done = set[int](), set[int]()
    try:
        while len(done) < len(choices):
            if len(started) == len(choices):  # no timer per output once every choice streams
                index, item = await queue.get()
            else:
                try:
                    async with asyncio.timeout(keepalive):
                        index, item = await queue.get()
                except TimeoutError:
                    yield None
                    continue
            if isinstance(item, BaseException):
                raise item
            started.add(index)
            if item.finished:
                done.add(index)
            yield index, item
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def stream_failure(exc: Exception, response_id: str) -> APIError:
    """The error a stream that already started ends with (an unexpected one is logged); counted."""
    error = from_engine_error(exc)
    if error is None:
        log.error("error while streaming %s", response_id, exc_info=exc)
        error = internal_error()
    note_stream_error(error)
    return error


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
        watch = _SendWatch(self._stall_timeout)

        async def bounded_send(message: Message) -> None:
            if watch.task is None:  # the task that sends (Starlette streams from a task of its own)
                watch.task = asyncio.current_task()
            watch.sending_since = watch.loop.time()
            try:
                await send(message)
            except asyncio.CancelledError:
                if watch.stalled:
                    raise _StalledClient from None
                raise
            finally:
                watch.sending_since = None

        try:
            await super().__call__(scope, receive, bounded_send)
        except _StalledClient:
            log.warning(
                "a streaming client read nothing for %g s; its request is cancelled", self._stall_timeout
            )
        finally:
            watch.stop()
            await self._events.aclose()
            await self._release()


class _SendWatch:
    """One timer per stream, not one per event: every quarter of ``stall_timeout`` it looks whether a send
    has waited that long (a client that reads nothing) and cancels the sending task if so; that send then
    raises _StalledClient, as a timeout around each send did."""

    def __init__(self, stall_timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task[Any] | None = None
        self.stall_timeout = stall_timeout
        self.sending_since: float | None = None
        self.stalled = False
        self._timer = self.loop.call_later(stall_timeout / 4, self._check)

    def _check(self) -> None:
        since = self.sending_since
        if since is not None and self.loop.time() - since >= self.stall_timeout and self.task is not None:
            self.stalled = True
            self.task.cancel()
            return
        self._timer = self.loop.call_later(self.stall_timeout / 4, self._check)

    def stop(self) -> None:
        self._timer.cancel()


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


async def abort_on_disconnect(request: Request, engine: AsyncEngine, request_ids: list[str]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for request_id in request_ids:
        engine.abort(request_id)  # the request's consumer receives a final output and returns


async def collect(
    request: Request, engine: AsyncEngine, choices: list[Choice]
) -> list[tuple[str, RequestOutput, list[TokenLogprobs]]]:
    """The whole text (and logprobs) of each choice of a non-streamed request; a client that disconnects
    aborts them all."""
    watcher = asyncio.create_task(abort_on_disconnect(request, engine, [c.request_id for c in choices]))
    tasks = [asyncio.create_task(_collect_one(c)) for c in choices]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:  # one choice failed: stop the others before their generators are closed
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        failure = next((t.exception() for t in tasks if not t.cancelled() and t.exception()), None)
        if failure is not None:
            raise failure
        return [task.result() for task in tasks]
    except Exception as exc:
        error = from_engine_error(exc)
        if error is None:
            raise
        raise error from None
    finally:
        watcher.cancel()
        for task in tasks:  # the handler itself was cancelled: so are its choices
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await release_choices(choices)


async def _collect_one(choice: Choice) -> tuple[str, RequestOutput, list[TokenLogprobs]]:
    out = await choice.first
    parts, logprobs = [out.text_delta], list(out.new_logprobs)
    while not out.finished:
        out = await anext(choice.outputs)
        parts.append(out.text_delta)
        logprobs += out.new_logprobs
    return "".join(parts), out, logprobs


async def release_choices(choices: list[Choice]) -> None:
    for choice in choices:
        await release_request(choice.first, choice.outputs)
