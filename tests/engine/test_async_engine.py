"""The engine thread and the event loop: a step's outputs reach their requests together, a deadline is one
timer per request, and both lose nothing (tiny real model, llama.cpp)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.engine.async_engine import AsyncEngine, RequestTimeoutError
from specserve.engine.builder import flat_costs
from specserve.engine.core_thread import ThreadCore
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.request import SamplingParams
from support.tiny_models import TinyModels

PROMPTS = ["def add(a, b):", "class Point:", "import os\nimport sys", "for i in range(10):"]


@pytest.fixture
def engine(tiny_models: TinyModels) -> Iterator[AsyncEngine]:
    target = LlamaCppRuntime(tiny_models.target, context_per_sequence=4096, max_sequences=4, n_threads=1)
    core = SpeculativeEngine(target, {}, FixedLengthPolicy(), CostModel(flat_costs()), EngineOptions((), 0))
    running = AsyncEngine(ThreadCore(core), core.target, core.grammars)
    yield running
    running.close()


async def _tokens(engine: AsyncEngine, name: str, prompt: str, max_tokens: int, **kw: Any) -> list[int]:
    ids = engine.vocabulary.tokenize(prompt)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    tokens: list[int] = []
    async for out in engine.generate(name, ids, params, **kw):
        tokens += out.new_token_ids
    return tokens


def test_a_steps_outputs_reach_their_requests_with_one_wake_up(engine: AsyncEngine) -> None:
    """Four requests decode together; each gets every token it would get alone, and the engine thread
    wakes the event loop once per step, not once per request's output."""
    alone = [asyncio.run(_tokens(engine, f"alone-{i}", p, 24)) for i, p in enumerate(PROMPTS)]
    wake_ups = 0

    async def together() -> list[list[int]]:
        nonlocal wake_ups
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal wake_ups
            wake_ups += 1
            return threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign, assignment]
        return list(await asyncio.gather(*(_tokens(engine, f"b-{i}", p, 24) for i, p in enumerate(PROMPTS))))

    assert asyncio.run(together()) == alone
    outputs = 4 * 24  # plain decoding: one output per request per step
    assert wake_ups <= 24 + 8, f"{wake_ups} wake-ups for {outputs} outputs in about 24 steps"
    assert engine.num_running == 0


def test_a_deadline_ends_the_request_and_frees_it(engine: AsyncEngine) -> None:
    async def timed_out() -> None:
        with pytest.raises(RequestTimeoutError, match=r"0\.05 s timeout"):
            await _tokens(engine, "slow", PROMPTS[0], 3_000, timeout=0.05)
        other = await _tokens(engine, "next", PROMPTS[1], 8, timeout=30)  # the engine goes on
        assert len(other) == 8

    asyncio.run(timed_out())
    assert engine.num_running == 0 and engine.num_waiting == 0
