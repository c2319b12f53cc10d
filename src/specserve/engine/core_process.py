"""The engine core in a process of its own (vLLM V1's split), and the API side's handle on it.

``ProcessCore.start(settings)`` starts ``python -m specserve.engine.core_process <fd>`` with one end of a
socket pair, sends it the settings and waits while it loads and calibrates the models. Then the child loops
as every host does (engine/core.py): apply the commands that came, step, send the step's one message.
Its reader thread receives commands (and compiles a request's grammar there, so that the step only copies
it). In the API process the socket is read on the event loop (``add_reader``): one wake-up per step.

Failure: the child ignores SIGINT (the server drains and then closes the channel, which stops it). If the
child dies, the API side reads end-of-file: every request in flight fails with EngineDeadError and the
owner is told (``CoreEvents.on_dead``; the server then exits non-zero, for its supervisor to restart). If
the API process dies, the child reads end-of-file and exits.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Literal

from specserve.config import Settings
from specserve.engine.channel import Channel
from specserve.engine.core import (
    Abort,
    Call,
    CallResult,
    Command,
    CoreHost,
    EngineCore,
    EngineDeadError,
    EngineFacts,
    StepMessage,
    Submit,
)

log = logging.getLogger("specserve.engine")

STOP_WAIT_S = 30.0
"""How long ``close`` waits for the child to release its models before killing it."""


@dataclass(frozen=True)
class Ready:
    facts: EngineFacts
    report: Any
    """The builder's BuildReport."""
    target_path: str
    """The target model's file or directory, for the API process's own vocabulary."""


@dataclass(frozen=True)
class LoadFailed:
    message: str
    expected: bool
    """A user's mistake (a bad model file): log one line, no traceback."""


@dataclass(frozen=True)
class Died:
    message: str


class EngineLoadError(Exception):
    """The engine process could not load the models (its message says why)."""

    def __init__(self, message: str, expected: bool) -> None:
        super().__init__(message)
        self.expected = expected


class ProcessCore(CoreHost):
    """The API side of an engine process."""

    def __init__(self, process: subprocess.Popen[bytes], channel: Channel, ready: Ready) -> None:
        self.process = process
        self.pid = process.pid
        self.facts = ready.facts
        self.report = ready.report
        self.target_path = ready.target_path
        self._channel = channel
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._died = ""
        self._closing = False

    @classmethod
    def start(cls, settings: Settings) -> ProcessCore:
        """Start the engine process and wait until its models are loaded; EngineLoadError if they cannot."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [sys.executable, "-m", "specserve.engine.core_process", str(theirs.fileno())]
        process = subprocess.Popen(command, pass_fds=(theirs.fileno(),))
        theirs.close()
        channel = Channel(ours)
        try:
            channel.send(settings)
            reply = channel.receive_one()
        except (OSError, EOFError):
            process.wait()
            raise EngineLoadError(
                f"the engine process exited with status {process.returncode}", False
            ) from None
        if isinstance(reply, LoadFailed):
            process.wait()
            channel.close()
            raise EngineLoadError(reply.message, reply.expected)
        return cls(process, channel, reply)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is self._loop:
            return
        old, self._loop = self._loop, loop
        if old is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # a closed loop, or a closed socket
                old.remove_reader(self._channel.fileno())
        if self.error is None:
            self._channel.sock.setblocking(False)  # an event loop may call its reader for nothing
            loop.add_reader(self._channel.fileno(), self._readable)

    def submit(self, submit: Submit) -> None:
        self._send(submit)

    def abort(self, request_ids: list[str], reason: Literal["abort", "stop"]) -> None:
        self._send(Abort(request_ids, reason))

    def call(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self._send(Call(call_id, method, args))
        return future

    def close(self) -> None:
        """Ask the child to release its models and exit; kill it if it does not in STOP_WAIT_S."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._channel.send(None)
        try:
            self.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop in %g s: killing it", STOP_WAIT_S)
            self.process.kill()
            self.process.wait()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError, ValueError):
                loop.call_soon_threadsafe(self._detach)
        else:
            self._channel.close()

    def _detach(self) -> None:
        with contextlib.suppress(RuntimeError, ValueError):
            if self._loop is not None:
                self._loop.remove_reader(self._channel.fileno())
        self._channel.close()

    def _send(self, command: Command) -> None:
        if self.error is not None:
            raise self.error
        try:
            self._channel.send(command)
        except OSError as exc:
            self._dead(f"the engine process is gone ({exc})")
            raise EngineDeadError(str(self.error)) from None

    # -- the event loop's reader ------------------------------------------------------------------

    def _readable(self) -> None:
        try:
            messages = self._channel.receive()
        except (OSError, EOFError):
            code = self.process.wait()
            self._dead(self._died or f"the engine process exited with status {code}")
            return
        events = self.events
        for message in messages:
            if isinstance(message, tuple):  # a step message (StepMessage.to_wire)
                if events is not None:
                    events.on_step(StepMessage.from_wire(message))
            elif isinstance(message, CallResult):
                future = self._calls.pop(message.call_id, None)
                if future is not None:
                    if message.error is None:
                        future.set_result(message.value)
                    else:
                        future.set_exception(RuntimeError(message.error))
            elif isinstance(message, Died):
                self._died = message.message

    def _dead(self, reason: str) -> None:
        if self.error is not None:
            return
        if self._closing:
            reason = "engine shut down"
        else:
            log.error("the engine process stopped: %s", reason)
        self.error = EngineDeadError(reason)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                self._loop.remove_reader(self._channel.fileno())
        for future in self._calls.values():
            future.set_exception(self.error)
        self._calls.clear()
        if self.events is not None:
            self.events.on_dead(self.error)


# -- the engine process -----------------------------------------------------------------------------


class _Inbox:
    """Commands from the API process, received on a thread of their own."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.commands: collections.deque[Command | None] = collections.deque()  # appends are thread-safe
        self.wake = threading.Event()
        self.loaded = threading.Event()
        self.core: EngineCore | None = None

    def read(self) -> None:
        while True:
            try:
                messages = self.channel.receive()
            except (OSError, EOFError):
                messages = [None]  # the API process is gone (or closed the channel): stop
            for message in messages:
                if message is None and not self.loaded.is_set():
                    os._exit(0)  # nothing loaded yet worth releasing
                if isinstance(message, Submit) and message.params.grammar is not None and self.core:
                    with contextlib.suppress(Exception):  # compiled here, copied by the step
                        self.core.engine.grammars.compile(message.params.grammar)
                self.commands.append(message)
                self.wake.set()
                if message is None:
                    return


def main(fd: int) -> int:
    for stop in (signal.SIGINT, signal.SIGTERM):  # the API process drains, then closes the channel
        signal.signal(stop, signal.SIG_IGN)
    channel = Channel(socket.socket(fileno=fd))
    settings: Settings = channel.receive_one()
    from specserve.engine.builder import build_engine
    from specserve.logging import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    inbox = _Inbox(channel)
    threading.Thread(target=inbox.read, name="specserve-engine-inbox", daemon=True).start()
    try:
        engine, report = build_engine(settings)
        engine.grammars.tokenizer()  # llguidance's view of the vocabulary, before the first request
    except Exception as exc:
        from specserve.errors import UserError

        expected = isinstance(exc, UserError | ValueError)
        log.error("loading the models failed: %s", exc, exc_info=not expected)
        channel.send(LoadFailed(f"loading the models failed: {exc}", expected))
        return 1
    core = inbox.core = EngineCore(engine)
    inbox.loaded.set()
    channel.send(Ready(core.facts(), report, report.target_path))
    try:
        _serve(core, inbox, channel)
    except BaseException as exc:
        log.exception("the engine process failed")
        with contextlib.suppress(OSError):
            channel.send(Died(f"the engine failed: {type(exc).__name__}: {exc}"))
        return 1
    engine.close()
    channel.close()
    return 0


def _serve(core: EngineCore, inbox: _Inbox, channel: Channel) -> None:
    """The engine loop: apply what came, step, send the step's message; until the channel closes."""
    commands = inbox.commands
    while True:
        if not core.has_work() and not commands:
            inbox.wake.wait()
        inbox.wake.clear()
        while commands:
            command = commands.popleft()
            if command is None:
                return
            result = core.apply(command)
            if result is not None:
                channel.send(result)
        message = core.step()
        if message is not None:
            try:
                channel.send(message.to_wire())
            except OSError:  # the API process is gone
                return


if __name__ == "__main__":
    # Run the module under its own name, not as __main__: what it pickles must unpickle in the API process.
    from specserve.engine import core_process

    sys.exit(core_process.main(int(sys.argv[1])))
