"""The server's one interface to the running engine: requests in, each request's outputs as an async stream.

The engine core runs elsewhere — in a process of its own (engine/core_process.py, the server's default) or
on a thread (engine/core_thread.py) — and sends one message per step with every request's new token ids.
Here, on the event loop, the output processor turns them into text (stop strings included) and each
request's queue gets its output: one wake-up of the loop per step, whatever the batch, and one timer per
request for its deadline. Admission control (a bounded waiting queue) happens here, before a request
reaches the core.

What the server reads of the engine's state (counters, the prefix cache, the drafters) is the last
:class:`EngineSnapshot` fetched (``refresh``, between two steps), apart from what each step message
updates (running sequences, the drafters loaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from specserve.backends.base import RuntimeInfo, Vocabulary
from specserve.engine.core import CoreHost, EngineDeadError, EngineSnapshot, StepMessage, Submit
from specserve.engine.output_processor import OutputProcessor, RequestOutput
from specserve.engine.prefix_cache import PrefixCacheStats
from specserve.engine.stats import EngineStats
from specserve.request import SamplingParams
from specserve.sequence import SpeculationOptions
from specserve.structured.grammar import GrammarCompiler

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "QueueFullError",
    "RequestFailedError",
    "RequestTimeoutError",
]


class QueueFullError(Exception):
    """The waiting queue is full; the client should retry later."""


class RequestTimeoutError(Exception):
    """The request ran past its deadline and was aborted."""


class RequestFailedError(Exception):
    """The engine failed this one request (finish reason ``error``, logged); the others go on."""


_Item = RequestOutput | BaseException


class _Outputs:
    """One request's outputs on their way to its consumer. While the consumer is behind, a new output is
    merged into the one waiting (vLLM's RequestOutputCollector): a stream that could not keep up with the
    steps sends their tokens in one event and one write, instead of falling further behind one write at a
    time. An error replaces whatever waits (the request ends with it)."""

    __slots__ = ("_item", "_waiter")

    def __init__(self) -> None:
        self._item: _Item | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: _Item) -> None:
        waiting = self._item
        if isinstance(item, RequestOutput) and isinstance(waiting, RequestOutput):
            waiting.merge(item)
        elif not isinstance(waiting, BaseException):
            self._item = item
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> _Item:
        while self._item is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item, self._item = self._item, None
        return item


class AsyncEngine:
    """An engine core (on a thread or in a process) with an async, per-request output stream."""

    def __init__(
        self, core: CoreHost, vocabulary: Vocabulary, grammars: GrammarCompiler, max_waiting: int = 64
    ) -> None:
        facts = core.facts
        self.info: RuntimeInfo = facts.info
        """The target's static facts (vocabulary size, context, exactness)."""
        self.vocabulary = vocabulary
        """Tokenizing, detokenizing and the chat template, in this process."""
        self.grammars = grammars
        """Structured outputs' grammar compiler (the server compiles to check; the core compiles again)."""
        self.max_waiting = max_waiting
        self.max_running = facts.max_running
        self.configured_drafters = facts.configured_drafters
        """The drafters the policy may choose from when a request names none (``auto``)."""
        self.snapshot: EngineSnapshot = facts.snapshot
        self.step_observers: list[Callable[[StepMessage], None]] = []
        """Called on the event loop with each step's message, before its outputs reach their requests."""
        self.on_death: Callable[[BaseException], None] | None = None
        self._core = core
        self._outputs = OutputProcessor(vocabulary.token_bytes)
        self._queues: dict[str, _Outputs] = {}
        self._num_running = 0
        core.events = self

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped, once it has."""
        return self._core.error

    @property
    def engine_pid(self) -> int | None:
        """The engine process (None when the engine runs on a thread of this one)."""
        return self._core.pid

    # -- requests ----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._outputs) - self._num_running)

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        speculation: SpeculationOptions | None = None,
        timeout: float | None = None,
        cache_salt: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; aborts it if the consumer goes away."""
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        # Capacity is max_running + max_waiting requests in flight.
        if len(self._outputs) - self.max_running >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        loop = asyncio.get_running_loop()
        self._core.attach(loop)
        state = self._outputs.add(request_id, prompt_ids, params, time.perf_counter())
        outputs = _Outputs()
        self._queues[request_id] = outputs
        try:
            self._core.submit(
                Submit(request_id, prompt_ids, params, speculation, cache_salt, state.arrival_time)
            )
        except EngineDeadError:
            self._forget(request_id)
            raise
        # One timer per request, not one per output: a deadline that passes puts its error in the queue.
        expiry = None
        if timeout is not None:
            error = RequestTimeoutError(f"request exceeded its {timeout:g} s timeout")
            expiry = loop.call_later(timeout, outputs.put, error)
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = not isinstance(item, RequestTimeoutError)  # a timeout aborts (finally)
                    raise item
                finished = item.finished
                if finished and item.state.finish_reason == "error":
                    raise RequestFailedError(f"request {request_id} failed in the engine")
                if finished and item.state.finish_reason == "refused":
                    raise ValueError(item.state.error)
                yield item
                if finished:
                    return
        finally:
            if expiry is not None:
                expiry.cancel()
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request early; its consumer (if still there) gets its last output when the core has."""
        if request_id in self._outputs and self.error is None:
            with contextlib.suppress(EngineDeadError):  # on_dead ends it
                self._core.abort([request_id], "abort")

    def _forget(self, request_id: str) -> None:
        self._outputs.drop(request_id)
        self._queues.pop(request_id, None)

    # -- the core's events (on the event loop) -----------------------------------------------------

    def on_step(self, message: StepMessage) -> None:
        for observer in self.step_observers:  # first: a client never sees output before its metrics
            observer(message)
        self._num_running = message.num_running
        if message.drafters is not None:
            self.snapshot = dataclasses.replace(self.snapshot, drafters=message.drafters)
        queues = self._queues
        for out in message.outputs:
            result = self._outputs.process(out)
            queue = queues.pop(out.request_id, None) if out.finished else queues.get(out.request_id)
            if result is not None and queue is not None:
                queue.put(result)
        stops = self._outputs.take_stops()
        if stops and self.error is None:
            self._core.abort(stops, "stop")

    def on_dead(self, error: BaseException) -> None:
        for request_id in self._outputs.request_ids():
            queue = self._queues.get(request_id)
            self._forget(request_id)
            if queue is not None:
                queue.put(EngineDeadError(str(error)))
        self._num_running = 0
        if self.on_death is not None:
            self.on_death(error)

    # -- the engine's state ------------------------------------------------------------------------

    async def refresh(self, timeout: float = 10.0) -> EngineSnapshot:
        """Fetch the engine's state between two steps (counters, prefix cache, drafters)."""
        self.snapshot = await self._call(timeout, "snapshot")
        return self.snapshot

    def loaded_drafters(self) -> list[str]:
        """The drafters that can run now (one that failed repeatedly is gone)."""
        return list(self.snapshot.drafters)

    def disabled_drafters(self) -> list[str]:
        """Configured drafters disabled after repeated failures."""
        return [name for name in self.configured_drafters if name not in self.snapshot.drafters]

    @property
    def speculation_enabled(self) -> bool:
        """The server-wide switch (``POST /admin/speculation``)."""
        return self.snapshot.speculation_enabled

    def speculation_active(self) -> bool:
        """The switch is on and at least one of the configured drafters is still loaded."""
        loaded = self.snapshot.drafters
        return self.speculation_enabled and any(name in loaded for name in self.configured_drafters)

    @property
    def stats(self) -> EngineStats:
        """The engine's counters as of the last ``refresh``."""
        return self.snapshot.stats

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return self.snapshot.prefix_cache

    def prefix_cache_usage(self) -> dict[str, int]:
        """Tokens and bytes each tier of the prefix cache holds (empty without a prefix cache)."""
        return self.snapshot.prefix_cache_usage

    def kv_usage(self) -> float:
        """Share of the KV cache the running sequences fill, in [0, 1], as of the last ``refresh``."""
        return self.snapshot.kv_usage

    async def set_speculation(self, enabled: bool, timeout: float) -> None:
        """Turn speculation on or off between two steps: running requests continue, nothing is lost.
        Raises EngineDeadError (or TimeoutError) when the engine does not apply it."""
        await self._call(timeout, "switch_speculation", enabled)
        self.snapshot = dataclasses.replace(self.snapshot, speculation_enabled=enabled)

    async def held_block_hashes(self, timeout: float) -> list[bytes]:
        """Every block hash the prefix cache can serve (read between two steps); empty without one."""
        hashes: list[bytes] = await self._call(timeout, "held_block_hashes")
        return hashes

    async def engine_heap(self, timeout: float) -> dict[str, Any]:
        """The engine process's traced Python heap (``engine.core.traced_heap``)."""
        if self.engine_pid is None:
            return {"tracing": False, "same_process": True}
        heap: dict[str, Any] = await self._call(timeout, "heap")
        return heap

    async def _call(self, timeout: float, method: str, *args: Any) -> Any:
        if self.error is not None:
            raise EngineDeadError(f"engine stopped: {self.error}")
        self._core.attach(asyncio.get_running_loop())
        return await asyncio.wait_for(asyncio.wrap_future(self._core.call(method, *args)), timeout)

    def close(self) -> None:
        """Stop the engine core and release the models (any thread)."""
        self._core.close()
