"""The engine core on a thread of this process: the in-process mode (tests, ``--no-engine-process``).

Commands reach the thread through a queue; each step's message goes to the attached event loop with one
``call_soon_threadsafe`` (one wake-up per step, whatever the batch). The engine stays private to the thread
(llama.cpp contexts are not thread-safe): calls run on it between two steps.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable
from typing import Any, Literal

from specserve.engine.core import (
    Abort,
    Call,
    Command,
    CoreHost,
    EngineCore,
    EngineDeadError,
    Submit,
)
from specserve.engine.engine import SpeculativeEngine

log = logging.getLogger("specserve.async_engine")


class ThreadCore(CoreHost):
    """Runs the engine core on a daemon thread from construction until ``close``."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine = engine
        self._core = EngineCore(engine)
        self.facts = self._core.facts()
        self._commands: collections.deque[Command | None] = collections.deque()  # thread-safe appends
        self._wake = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def submit(self, submit: Submit) -> None:
        self._send(submit)

    def abort(self, request_ids: list[str], reason: Literal["abort", "stop"]) -> None:
        self._send(Abort(request_ids, reason))

    def call(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if self.error is not None or self._stopped:
            future.set_exception(EngineDeadError(f"engine stopped: {self.error}"))
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self._send(Call(call_id, method, args))
        return future

    def shutdown(self) -> None:
        """Stop the thread (requests in flight end with EngineDeadError); the models stay loaded."""
        self._stopped = True
        self._commands.append(None)
        self._wake.set()
        self._thread.join(timeout=30)

    def close(self) -> None:
        self.shutdown()
        self.engine.close()

    def _send(self, command: Command) -> None:
        self._commands.append(command)
        self._wake.set()

    # -- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        core = self._core
        try:
            while True:
                if not core.has_work() and not self._commands:
                    self._wake.wait()
                self._wake.clear()
                if not self._drain():
                    self._end(EngineDeadError("engine shut down"))
                    return
                message = core.step()
                if message is not None and self.events is not None:
                    self._deliver(self.events.on_step, message)
        except BaseException as exc:  # a dead engine must not leave clients waiting forever
            log.exception("engine thread died")
            self.error = exc
            self._end(EngineDeadError(f"engine failed: {exc}"))

    def _drain(self) -> bool:
        """Apply the commands waiting; False when asked to stop."""
        commands = self._commands
        while commands:
            command = commands.popleft()
            if command is None:
                return False
            result = self._core.apply(command)
            if result is not None:
                future = self._calls.pop(result.call_id)
                if result.error is None:
                    future.set_result(result.value)
                else:
                    future.set_exception(RuntimeError(result.error))
        return True

    def _end(self, error: EngineDeadError) -> None:
        for future in self._calls.values():
            future.set_exception(error)
        self._calls.clear()
        if self.events is not None:
            self._deliver(self.events.on_dead, error)

    def _deliver(self, fn: Callable[[Any], None], arg: Any) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: its consumers are gone
                loop.call_soon_threadsafe(fn, arg)
