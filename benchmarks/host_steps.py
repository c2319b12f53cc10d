"""Host time of one engine step, phase by phase, on a model that costs (almost) nothing.

The engine runs in process on the null runtime (fixed logits at Qwen's 151,936-wide vocabulary, numpy or
a torch tensor) or on the tiny GGUF through llama.cpp, with ``batch`` sequences decoding together, plain
(no drafts) or with ``k``-token n-gram drafts that are all accepted. Each phase is timed by wrapping the
engine's own methods on the instance (nothing in the engine changes for it):

- ``schedule``: the scheduler's batch; ``plan``: the draft policy; ``draft``: the drafters' proposals;
- ``forward``: the runtime's ``decode`` (the null runtime's is a slice); ``evaluate``: the rest of the
  target pass (chunks, prompt logprobs, drafters told of committed tokens);
- ``verify``: the one batched verification; ``commit``: acceptance, rollback, stop checks, detokenizing
  and each request's output; ``other``: the step less all of these.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.backends.base import ModelRuntime
from specserve.drafters.ngram import NgramDrafter
from specserve.engine.builder import flat_costs
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.request import SamplingParams
from specserve.sequence import SpeculationOptions

PHASES = ("schedule", "plan", "draft", "forward", "evaluate", "verify", "commit", "other")


@dataclass
class StepTimes:
    """Seconds per phase summed over the timed steps, the steps, and the tokens they emitted."""

    runtime: str
    batch: int
    draft_tokens: int
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: int = 0
    tokens: int = 0

    def row(self) -> dict[str, Any]:
        us = {p: 1e6 * self.seconds[p] / max(self.steps, 1) for p in PHASES}
        total = 1e6 * self.seconds["step"] / max(self.steps, 1)
        host = total - us["forward"]
        return {
            "runtime": self.runtime,
            "batch": self.batch,
            "draft_tokens": self.draft_tokens,
            "steps": self.steps,
            "tokens_per_step": round(self.tokens / max(self.steps, 1), 2),
            "step_us": round(total, 1),
            "host_us": round(host, 1),
            "host_us_per_token": round(host * self.steps / max(self.tokens, 1), 2),
            **{f"{p}_us": round(v, 1) for p, v in us.items()},
        }


def _timed(times: StepTimes, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.seconds[phase] += time.perf_counter() - start

    return wrapper


def _instrument(engine: SpeculativeEngine, times: StepTimes) -> None:
    """Wrap the step's phases on this instance; ``evaluate`` is booked less the forward inside it."""
    engine.scheduler.schedule = _timed(times, "schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine.drafting.plan = _timed(times, "plan", engine.drafting.plan)  # type: ignore[method-assign]
    engine.drafting.propose = _timed(times, "draft", engine.drafting.propose)  # type: ignore[method-assign]
    engine.target.decode = _timed(times, "forward", engine.target.decode)  # type: ignore[method-assign]
    engine._evaluate = _timed(times, "evaluate", engine._evaluate)  # type: ignore[method-assign]
    engine._verify = _timed(times, "verify", engine._verify)  # type: ignore[method-assign]
    engine._commit_step = _timed(times, "commit", engine._commit_step)  # type: ignore[method-assign]


def measure(
    runtime: ModelRuntime[Any],
    name: str,
    batch: int,
    draft_tokens: int,
    prompt: list[int],
    steps: int = 200,
    warmup: int = 20,
) -> StepTimes:
    """``steps`` steps of ``batch`` sequences past ``warmup`` steps (prefill and the drafters' first
    matches out of the way); every sequence decodes throughout."""
    drafters = {"ngram": NgramDrafter()} if draft_tokens else {}
    options = EngineOptions(tuple(drafters), draft_tokens, speculation_enabled=bool(draft_tokens))
    engine = SpeculativeEngine(
        runtime, drafters, FixedLengthPolicy(), CostModel(flat_costs()), options, prefill_budget=1 << 16
    )
    per_step = draft_tokens + 1
    params = SamplingParams(max_tokens=(steps + warmup + 4) * per_step, ignore_eos=True)
    speculation = SpeculationOptions(drafter="ngram" if draft_tokens else "none")
    for i in range(batch):
        engine.add_request(f"{name}-{i}", prompt, params, speculation, cache_salt=f"{i}")
    for _ in range(warmup):
        engine.step()
    times = StepTimes(name, batch, draft_tokens)
    _instrument(engine, times)
    try:
        _timed_steps(engine, times, steps, batch)
    finally:
        del runtime.decode  # the instance's wrapper: the runtime serves the next measurement unwrapped
    times.seconds["evaluate"] -= times.seconds["forward"]  # the forward runs inside the target pass
    accounted = sum(times.seconds[p] for p in PHASES if p != "other")
    times.seconds["other"] = times.seconds["step"] - accounted
    for i in range(batch):
        engine.abort(f"{name}-{i}")
    return times


def _timed_steps(engine: SpeculativeEngine, times: StepTimes, steps: int, batch: int) -> None:
    for _ in range(steps):
        start = time.perf_counter()
        outputs = engine.step()
        times.seconds["step"] += time.perf_counter() - start
        times.steps += 1
        times.tokens += sum(len(o.new_token_ids) for o in outputs)
        if len(outputs) != batch:
            raise RuntimeError(f"{len(outputs)} of {batch} sequences emitted in a timed step")
