"""The engine thread and the event loop: a step's outputs reach their requests together, a deadline is one
timer per request, and both lose nothing (tiny real model, llama.cpp)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.engine.async_engine import AsyncEngine, RequestFailedError, RequestTimeoutError, _Outputs
from specserve.engine.builder import flat_costs
from specserve.engine.core_thread import ThreadCore
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.engine.output_processor import RequestOutput, RequestState
from specserve.engine.output_text import OutputText
from specserve.request import SamplingParams
from specserve.sequence import Sequence
from specserve.verify.logprobs import TokenLogprobs
from support.faulty_drafter import ExplodingDrafter
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


def test_outputs_waiting_for_a_consumer_that_is_behind_merge() -> None:
    """Three steps' outputs reach a consumer that was busy as one: ids, text and logprobs joined, the last
    one's end; an error then replaces whatever waits."""
    state = RequestState("r", [1], SamplingParams(), 0.0, OutputText(lambda t: b"x", ()))
    first, last = TokenLogprobs(1, -0.5, ()), TokenLogprobs(4, -0.25, ())
    waiting = _Outputs()
    waiting.put(RequestOutput(state, [1], "a", False, [first]))
    waiting.put(RequestOutput(state, [2, 3], "bc", False, []))
    waiting.put(RequestOutput(state, [4], "d", True, [last]))
    out = asyncio.run(waiting.get())
    assert isinstance(out, RequestOutput)
    assert (out.new_token_ids, out.text_delta, out.finished, out.new_logprobs) == (
        [1, 2, 3, 4],
        "abcd",
        True,
        [first, last],
    )
    waiting.put(RequestOutput(state, [5], "e", False))
    waiting.put(RequestTimeoutError("late"))
    waiting.put(RequestOutput(state, [6], "f", False))  # an error, once there, stays
    assert isinstance(asyncio.run(waiting.get()), RequestTimeoutError)


class _BeginFails(ExplodingDrafter):
    name = "begin-fails"

    def begin(self, seq: Sequence) -> None:
        if seq.request_id == "unlucky":
            raise RuntimeError("injected failure while taking the request")


def test_a_failure_while_taking_a_request_fails_it_alone(tiny_models: TinyModels) -> None:
    """Not a ValueError (a refusal, a 400) but a bug: that request fails (a 500), the engine goes on."""
    target = LlamaCppRuntime(tiny_models.target, context_per_sequence=512, max_sequences=2, n_threads=1)
    drafters = {"begin-fails": _BeginFails()}
    core = SpeculativeEngine(
        target, drafters, FixedLengthPolicy(), CostModel(flat_costs()), EngineOptions((), 0)
    )
    engine = AsyncEngine(ThreadCore(core), core.target, core.grammars)

    async def go() -> None:
        with pytest.raises(RequestFailedError):
            await _tokens(engine, "unlucky", PROMPTS[0], 4)
        assert len(await _tokens(engine, "lucky", PROMPTS[0], 4)) == 4

    try:
        asyncio.run(go())
        assert engine.num_running == 0 and engine.num_waiting == 0
    finally:
        engine.close()
