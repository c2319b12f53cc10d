"""The engine on its own thread, driven from asyncio.

Model computation never runs on the event loop: a single engine thread owns the engine (llama.cpp contexts
are not thread-safe) and loops ``step()`` while there is work. Requests and aborts reach it through a
command queue; a step's outputs go back to their requests' ``asyncio.Queue`` with one ``call_soon_threadsafe``
per event loop (one wake-up per step, whatever the batch), and a request's deadline is one timer of its own.
Admission control (a bounded waiting queue) happens here, before a request reaches the engine.

This class is the server's one interface to the running engine: requests (``generate``, ``abort``), what is
served (``info``, ``vocabulary``, the drafters), the counters, the speculation switch and the prefix cache's
index. The :class:`SpeculativeEngine` itself stays private to the engine thread; anything that must change
it runs there between two steps (``_call_soon``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from specserve.backends.base import RuntimeInfo, Vocabulary
from specserve.engine.engine import RequestOutput, SpeculativeEngine
from specserve.engine.prefix_cache import PrefixCacheStats
from specserve.engine.stats import EngineStats
from specserve.request import SamplingParams
from specserve.sequence import SpeculationOptions

log = logging.getLogger("specserve.async_engine")

T = TypeVar("T")


class QueueFullError(Exception):
    """The waiting queue is full; the client should retry later."""


class RequestTimeoutError(Exception):
    """The request ran past its deadline and was aborted."""


class EngineDeadError(Exception):
    """The engine thread stopped (a bug or a fatal backend error)."""


class RequestFailedError(Exception):
    """The engine failed this one request (finish reason ``error``, logged); the others go on."""


@dataclass(frozen=True)
class _Sink:
    """Where a request's outputs go: its queue, on the event loop that reads it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def __call__(self, item: RequestOutput | BaseException) -> None:
        """One item alone (an error, an abort's end); a step's outputs go together (``_deliver``)."""
        _deliver(self.loop, [(self.queue, item)])


def _deliver(
    loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue[RequestOutput | BaseException], Any]]
) -> None:
    """Hand items to their queues with one wake-up of their event loop; a closed loop has no reader."""
    with contextlib.suppress(RuntimeError):  # RuntimeError: the loop is closed, its consumers are gone
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput | BaseException], Any]]) -> None:
    for queue_, item in items:
        queue_.put_nowait(item)


@dataclass
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculation: SpeculationOptions | None
    cache_salt: str
    sink: _Sink


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[], Any]
    result: concurrent.futures.Future[Any]


_Command = _Submit | _Abort | _Call


class AsyncEngine:
    """Thread-hosted engine with an async, per-request output stream."""

    def __init__(self, engine: SpeculativeEngine, max_waiting: int = 64) -> None:
        self._engine = engine
        self.max_waiting = max_waiting
        self.info: RuntimeInfo = engine.target.info
        """The target's static facts (vocabulary size, context, exactness)."""
        self.vocabulary: Vocabulary = engine.target
        """Tokenizing and the chat template (any thread: llama.cpp's vocabulary is read-only)."""
        self.grammars = engine.grammars
        """Structured outputs' grammar compiler (thread-safe: the server compiles, the engine copies)."""
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._in_flight = 0  # submitted and not finished; guarded by _lock
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        self.step_observers: list[Callable[[list[RequestOutput], float], None]] = []
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    # -- public API (event loop side) -------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return max(0, self._in_flight - self.num_running)

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
        if self.error is not None or self._stopped:
            raise EngineDeadError(f"engine stopped: {self.error}")
        with self._lock:
            # Capacity is max_running + max_waiting requests in flight. (Subtracting the scheduler's running
            # list instead counted requests still in the command queue as waiting, while slots were free.)
            if self._in_flight - self._engine.scheduler.max_running >= self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            self._in_flight += 1
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._send(_Submit(request_id, prompt_ids, params, speculation, cache_salt, _Sink(loop, outputs)))
        # One timer per request, not one per output: a deadline that passes puts its error in the queue.
        # (A timeout around each get, or wait_for's task of its own, cost the event loop a timer and a
        # few turns per streamed token.)
        expiry = None
        if timeout is not None:
            error = RequestTimeoutError(f"request exceeded its {timeout:g} s timeout")
            expiry = loop.call_later(timeout, outputs.put_nowait, error)
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = not isinstance(item, RequestTimeoutError)  # a timeout aborts (finally)
                    raise item
                finished = item.finished
                if finished and item.seq.finish_reason == "error":
                    raise RequestFailedError(f"request {request_id} failed in the engine")
                yield item
                if finished:
                    return
        finally:
            if expiry is not None:
                expiry.cancel()
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    # -- what the engine serves, and its state (event loop side; reads of small values) ----------------

    def loaded_drafters(self) -> list[str]:
        """The drafters that can run now (one that failed repeatedly is gone)."""
        return list(self._engine.drafters)

    @property
    def configured_drafters(self) -> tuple[str, ...]:
        """The drafters the policy may choose from when a request names none (``auto``)."""
        return self._engine.options.drafters

    def disabled_drafters(self) -> list[str]:
        """Configured drafters disabled after repeated failures."""
        return self._engine.disabled_drafters()

    @property
    def speculation_enabled(self) -> bool:
        """The server-wide switch (``POST /admin/speculation``)."""
        return self._engine.options.speculation_enabled

    def speculation_active(self) -> bool:
        """The switch is on and at least one of the configured drafters is still loaded."""
        return self._engine.speculation_active()

    @property
    def stats(self) -> EngineStats:
        """The engine's counters (they only grow; step observers read them on the engine thread)."""
        return self._engine.stats

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        cache = self._engine.prefix_cache
        return None if cache is None else cache.stats

    def prefix_cache_usage(self) -> dict[str, int]:
        """Tokens and bytes each tier of the prefix cache holds (empty without a prefix cache)."""
        cache = self._engine.prefix_cache
        if cache is None:
            return {}
        return {
            "slot_tier_tokens": cache.slot_tier_tokens(),
            "slot_tier_bytes": cache.slot_tier_bytes(),
            "host_tier_tokens": cache.host_tier_tokens(),
            "host_tier_bytes": cache.host_tier_bytes(),
        }

    def kv_usage(self) -> float:
        """Share of the KV cache the running sequences fill, in [0, 1]."""
        return self._engine.kv_usage()

    async def set_speculation(self, enabled: bool, timeout: float) -> None:
        """Turn speculation on or off between two steps: running requests continue, nothing is lost.
        Raises EngineDeadError (or TimeoutError) when the engine thread does not apply it."""
        future = self._call_soon(lambda: self._engine.switch_speculation(enabled))
        await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    async def held_block_hashes(self, timeout: float) -> list[bytes]:
        """Every block hash the prefix cache can serve (read on the engine thread: the index changes under
        it); empty without a prefix cache."""
        cache = self._engine.prefix_cache
        if cache is None:
            return []
        return await asyncio.wait_for(asyncio.wrap_future(self._call_soon(cache.held_hashes)), timeout)

    def _call_soon(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread between two steps; the future gets its result or exception."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.error is not None or self._stopped:
            result.set_exception(EngineDeadError(f"engine stopped: {self.error}"))
        else:
            self._send(_Call(fn, result))
        return result

    def shutdown(self) -> None:
        """Stop the engine thread (waiting requests end with EngineDeadError); the models stay loaded."""
        self._stopped = True
        self._commands.put(None)
        self._wake.set()
        self._thread.join(timeout=30)

    def close(self) -> None:
        """Stop the engine thread and release the models."""
        self.shutdown()
        self._engine.close()

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        sinks: dict[str, _Sink] = {}
        try:
            while True:
                if not self._engine.has_work() and self._commands.empty():
                    self._wake.wait()
                self._wake.clear()
                if not self._drain(sinks):
                    for waiting in sinks.values():  # shut down: no consumer may wait forever
                        waiting(EngineDeadError("engine shut down"))
                    return
                if not self._engine.has_work():
                    continue
                start = time.perf_counter()
                outputs = self._engine.step()
                elapsed = time.perf_counter() - start
                for observer in self.step_observers:  # first: a client never sees output before its metrics
                    observer(outputs, elapsed)
                # One wake-up of each event loop per step, not one per request's output.
                batches: dict[asyncio.AbstractEventLoop, list[tuple[Any, RequestOutput]]] = {}
                for out in outputs:
                    sink = sinks.get(out.request_id)
                    if sink is not None:
                        batches.setdefault(sink.loop, []).append((sink.queue, out))
                    if out.finished:
                        self._done(sinks, out.request_id)
                for loop, items in batches.items():
                    _deliver(loop, items)
        except BaseException as exc:  # a dead engine must not leave clients waiting forever
            log.exception("engine thread died")
            self.error = exc
            for sink in sinks.values():
                sink(EngineDeadError(f"engine failed: {exc}"))

    def _drain(self, sinks: dict[str, _Sink]) -> bool:
        """Apply queued submissions and aborts; False when asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                return False
            if isinstance(command, _Call):
                try:
                    command.result.set_result(command.fn())
                except Exception as exc:
                    command.result.set_exception(exc)
                continue
            if isinstance(command, _Abort):
                seq = self._engine.scheduler.find(command.request_id)
                if seq is not None and self._engine.abort(command.request_id):
                    sink = sinks.get(command.request_id)
                    if sink is not None:  # a consumer may still wait: tell it the request ended
                        sink(RequestOutput(seq, [], "", True))
                    self._done(sinks, command.request_id)
                continue
            try:
                self._engine.add_request(
                    command.request_id,
                    command.prompt_ids,
                    command.params,
                    command.speculation,
                    command.cache_salt,
                )
            except ValueError as exc:
                command.sink(exc)
                with self._lock:
                    self._in_flight -= 1
                continue
            sinks[command.request_id] = command.sink

    def _done(self, sinks: dict[str, _Sink], request_id: str) -> None:
        if sinks.pop(request_id, None) is not None:
            with self._lock:
                self._in_flight -= 1
