"""The engine core: the one owner of a :class:`SpeculativeEngine`, driven by commands, one message per step.

Whoever hosts it — a thread of the server's process (engine/core_thread.py) or a process of its own
(engine/core_process.py) — runs the same loop::

    apply every command waiting (Submit, Abort, Call)
    message = core.step()          # one engine step, and whatever the commands ended
    send message                   # every request's new ids of the step, in one message

A :class:`StepMessage` carries each request's new token ids, never text: the output processor beside the
API server makes the text (engine/output_processor.py). What the server reads of the engine's state (its
counters, the prefix cache's usage, the drafters) it fetches with a :class:`Call` between two steps
(:class:`EngineSnapshot`), except the few things each step message carries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from specserve.backends.base import RuntimeInfo
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.outputs import EngineOutput, refused
from specserve.engine.prefix_cache import PrefixCacheStats
from specserve.engine.stats import EngineStats
from specserve.request import SamplingParams
from specserve.sequence import SpeculationOptions

log = logging.getLogger("specserve.engine")


class EngineDeadError(Exception):
    """The engine core stopped: its thread or process died, or the server shut it down."""


# -- commands (API side → core) -----------------------------------------------------------------------


@dataclass(slots=True)
class Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    speculation: SpeculationOptions | None
    cache_salt: str
    arrival_time: float
    """``time.perf_counter`` when the API took the request (its queue time starts there)."""


@dataclass(slots=True)
class Abort:
    request_ids: list[str]
    reason: Literal["abort", "stop"]
    """``stop``: the output processor found a stop string; ``abort``: the client went away or timed out."""


@dataclass(slots=True)
class Call:
    """A question or a change applied between two steps: one of :data:`CALLS`, answered by a CallResult."""

    call_id: int
    method: str
    args: tuple[Any, ...] = ()


Command = Submit | Abort | Call


# -- messages (core → API side) -----------------------------------------------------------------------


@dataclass(slots=True)
class StepMessage:
    """One step's outputs (and the last outputs of requests that commands ended), for every request."""

    outputs: list[EngineOutput]
    num_running: int
    """Sequences holding a slot after the step."""
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    """The step's drafting and its target pass (the metrics' per-step histograms)."""
    drafters: tuple[str, ...] | None = None
    """The drafters loaded, when that changed in this step (a drafter disabled after failures)."""

    def to_wire(self) -> tuple[Any, ...]:
        """The message as plain tuples, for a socket: they pickle about 20x faster than dataclasses (a step
        of one output: 0.3 us instead of 7 us; of eight: 1.2 us instead of 19 us)."""
        outputs = [
            (o.request_id, o.new_token_ids, o.finish_reason, o.new_logprobs, o.start, o.end, o.error)
            for o in self.outputs
        ]
        return outputs, self.num_running, self.draft_seconds, self.verify_seconds, self.drafters

    @classmethod
    def from_wire(cls, wire: tuple[Any, ...]) -> StepMessage:
        outputs, num_running, draft_seconds, verify_seconds, drafters = wire
        return cls([EngineOutput(*o) for o in outputs], num_running, draft_seconds, verify_seconds, drafters)


@dataclass(slots=True)
class CallResult:
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state as the server reads it, taken between two steps."""

    stats: EngineStats = field(default_factory=EngineStats)
    prefix_cache: PrefixCacheStats | None = None
    prefix_cache_usage: dict[str, int] = field(default_factory=dict)
    """Tokens and bytes each prefix-cache tier holds (empty without a prefix cache)."""
    kv_usage: float = 0.0
    drafters: tuple[str, ...] = ()
    """The drafters loaded now."""
    speculation_enabled: bool = True


@dataclass(frozen=True)
class EngineFacts:
    """What does not change while the engine runs: sent once, when it is ready."""

    info: RuntimeInfo
    max_running: int
    configured_drafters: tuple[str, ...]
    """The drafters the policy may choose from (``auto``); those loaded are in the snapshot."""
    snapshot: EngineSnapshot


CALLS = frozenset({"snapshot", "switch_speculation", "held_block_hashes", "heap"})


class EngineCore:
    """Applies commands to the engine and makes one :class:`StepMessage` per step."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine = engine
        self._ended: list[EngineOutput] = []  # last outputs of requests that commands ended or refused
        self._drafters = tuple(engine.drafters)

    def facts(self) -> EngineFacts:
        engine = self.engine
        return EngineFacts(
            engine.target.info, engine.scheduler.max_running, engine.options.drafters, self.snapshot()
        )

    def has_work(self) -> bool:
        return bool(self._ended) or self.engine.has_work()

    def apply(self, command: Command) -> CallResult | None:
        """Apply one command; a Call's result comes back at once (the host sends it on)."""
        if isinstance(command, Submit):
            try:
                seq = self.engine.add_request(
                    command.request_id,
                    command.prompt_ids,
                    command.params,
                    command.speculation,
                    command.cache_salt,
                )
            except ValueError as exc:  # a request the engine cannot take (prompt too long, bad ids)
                self._ended.append(refused(command.request_id, str(exc)))
            except Exception:  # a failure of ours while taking it: this request fails alone (a 500)
                log.exception("request %s failed as the engine took it", command.request_id)
                self._ended.append(EngineOutput(command.request_id, [], "error"))
            else:
                seq.arrival_time = command.arrival_time
            return None
        if isinstance(command, Abort):
            for request_id in command.request_ids:
                last = self.engine.abort(request_id, command.reason)
                if last is not None:
                    self._ended.append(last)
            return None
        return self.call(command)

    def call(self, command: Call) -> CallResult:
        if command.method not in CALLS:
            return CallResult(command.call_id, error=f"unknown call {command.method!r}")
        try:
            return CallResult(command.call_id, getattr(self, command.method)(*command.args))
        except Exception as exc:
            log.warning("engine call %s failed", command.method, exc_info=True)
            return CallResult(command.call_id, error=f"{type(exc).__name__}: {exc}")

    def step(self) -> StepMessage | None:
        """Run one step if there is work; the message of what it and the commands before it produced."""
        engine = self.engine
        outputs, self._ended = self._ended, []
        draft, verify = engine.stats.draft_seconds, engine.stats.verify_seconds
        if engine.has_work():
            outputs += engine.step()
        elif not outputs:
            return None
        message = StepMessage(
            outputs,
            len(engine.scheduler.running),
            engine.stats.draft_seconds - draft,
            engine.stats.verify_seconds - verify,
        )
        if len(engine.drafters) != len(self._drafters):  # drafters are only ever disabled
            self._drafters = message.drafters = tuple(engine.drafters)
        return message

    # -- calls ---------------------------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        engine, cache = self.engine, self.engine.prefix_cache
        usage = {}
        if cache is not None:
            usage = {
                "slot_tier_tokens": cache.slot_tier_tokens(),
                "slot_tier_bytes": cache.slot_tier_bytes(),
                "host_tier_tokens": cache.host_tier_tokens(),
                "host_tier_bytes": cache.host_tier_bytes(),
            }
        return EngineSnapshot(
            engine.stats.snapshot(),
            None if cache is None else replace(cache.stats),
            usage,
            engine.kv_usage(),
            tuple(engine.drafters),
            engine.options.speculation_enabled,
        )

    def switch_speculation(self, enabled: bool) -> None:
        self.engine.switch_speculation(enabled)

    def held_block_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache can serve (for the Ray router); empty without one."""
        cache = self.engine.prefix_cache
        return [] if cache is None else cache.held_hashes()

    def heap(self) -> dict[str, Any]:
        return traced_heap()


def traced_heap() -> dict[str, Any]:
    """This process's Python heap as ``tracemalloc`` traces it (when started with ``PYTHONTRACEMALLOC=1``):
    bytes now and at peak, and the ten largest allocation sites by line."""
    import tracemalloc

    if not tracemalloc.is_tracing():
        return {"tracing": False}
    current, peak = tracemalloc.get_traced_memory()
    stats = tracemalloc.take_snapshot().statistics("lineno")[:10]
    top = [{"where": str(s.traceback), "bytes": s.size, "blocks": s.count} for s in stats]
    return {"tracing": True, "traced_bytes": current, "peak_bytes": peak, "top": top}


# -- hosts ------------------------------------------------------------------------------------------


class CoreEvents(Protocol):
    """What a host tells its owner, always on the event loop it was attached to."""

    def on_step(self, message: StepMessage) -> None: ...

    def on_dead(self, error: BaseException) -> None: ...


class CoreHost(ABC):
    """Where the engine core runs, as the API side drives it: a thread (engine/core_thread.py) or a process
    of its own (engine/core_process.py). Every method but ``close`` is called on the event loop."""

    facts: EngineFacts
    events: CoreEvents | None = None
    error: BaseException | None = None
    """Why the core stopped, once it has."""
    pid: int | None = None
    """The engine process, when the core runs in one."""

    @abstractmethod
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver messages to ``loop`` from now on (called on that loop, before submitting from it)."""

    @abstractmethod
    def submit(self, submit: Submit) -> None: ...

    @abstractmethod
    def abort(self, request_ids: list[str], reason: Literal["abort", "stop"]) -> None: ...

    @abstractmethod
    def call(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        """Run ``EngineCore.<method>`` between two steps; the future gets its value, or EngineDeadError."""

    @abstractmethod
    def close(self) -> None:
        """Stop the core and release its models (any thread; waits for it)."""
