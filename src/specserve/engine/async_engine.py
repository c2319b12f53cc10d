"""The engine on its own thread, driven from asyncio.

Model computation never runs on the event loop: a single engine thread owns the engine (llama.cpp contexts
are not thread-safe) and loops ``step()`` while there is work. Requests and aborts reach it through a
command queue; outputs go back to each request's ``asyncio.Queue`` with ``call_soon_threadsafe``.
Admission control (a bounded waiting queue) happens here, before a request reaches the engine.
Anything else that must touch the engine (the admin switch) goes through ``call_soon`` to the same thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from specserve.engine.engine import RequestOutput, SpeculativeEngine
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


@dataclass
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculation: SpeculationOptions | None
    cache_salt: str
    sink: Callable[[RequestOutput | BaseException], None]


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
        self.engine = engine
        self.max_waiting = max_waiting
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
        return len(self.engine.scheduler.running)

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
            if self._in_flight - self.engine.scheduler.max_running >= self.max_waiting:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
            self._in_flight += 1
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        self._send(_Submit(request_id, prompt_ids, params, speculation, cache_salt, sink))
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = False
        try:
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RequestTimeoutError(f"request exceeded its {timeout:g} s timeout")
                try:
                    item = await asyncio.wait_for(outputs.get(), remaining)
                except TimeoutError:
                    continue
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                if finished and item.seq.finish_reason == "error":
                    raise RequestFailedError(f"request {request_id} failed in the engine")
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    def call_soon(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread between two steps; the future gets its result or exception."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.error is not None or self._stopped:
            result.set_exception(EngineDeadError(f"engine stopped: {self.error}"))
        else:
            self._send(_Call(fn, result))
        return result

    def shutdown(self) -> None:
        self._stopped = True
        self._commands.put(None)
        self._wake.set()
        self._thread.join(timeout=30)

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        try:
            while True:
                if not self.engine.has_work() and self._commands.empty():
                    self._wake.wait()
                self._wake.clear()
                if not self._drain(sinks):
                    for waiting in sinks.values():  # shut down: no consumer may wait forever
                        waiting(EngineDeadError("engine shut down"))
                    return
                if not self.engine.has_work():
                    continue
                start = time.perf_counter()
                outputs = self.engine.step()
                elapsed = time.perf_counter() - start
                for observer in self.step_observers:  # first: a client never sees output before its metrics
                    observer(outputs, elapsed)
                for out in outputs:
                    sink = sinks.get(out.request_id)
                    if sink is not None:
                        sink(out)
                    if out.finished:
                        self._done(sinks, out.request_id)
        except BaseException as exc:  # a dead engine must not leave clients waiting forever
            log.exception("engine thread died")
            self.error = exc
            for sink in sinks.values():
                sink(EngineDeadError(f"engine failed: {exc}"))

    def _drain(self, sinks: dict[str, Callable[[RequestOutput | BaseException], None]]) -> bool:
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
                seq = self.engine.scheduler.find(command.request_id)
                if seq is not None and self.engine.abort(command.request_id):
                    sink = sinks.get(command.request_id)
                    if sink is not None:  # a consumer may still wait: tell it the request ended
                        sink(RequestOutput(seq, [], "", True))
                    self._done(sinks, command.request_id)
                continue
            try:
                self.engine.add_request(
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

    def _done(
        self, sinks: dict[str, Callable[[RequestOutput | BaseException], None]], request_id: str
    ) -> None:
        if sinks.pop(request_id, None) is not None:
            with self._lock:
                self._in_flight -= 1
