"""The engine core in its own process (tiny real models, llama.cpp): one message per step for every request,
the same outputs as the engine on a thread, stop strings ended by the API side, calls between steps, and a
child that dies or is left behind handled."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from specserve.backends.vocabulary import open_vocabulary
from specserve.config import Settings
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.builder import build_engine
from specserve.engine.core import EngineDeadError, StepMessage
from specserve.engine.core_process import EngineLoadError, ProcessCore
from specserve.engine.core_thread import ThreadCore
from specserve.request import SamplingParams
from specserve.sequence import SpeculationOptions
from specserve.structured.grammar import GrammarCompiler
from support.tiny_models import TinyModels

PROMPTS = ["def add(a, b):", "class Point:", "import os\nimport sys", "for i in range(10):"]


def settings(models: TinyModels, directory: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "target": str(models.target),
        "draft": str(models.draft_close),
        "model_dir": str(directory / "store"),
        "threads": 1,
        "max_running": 4,
        "drafter": "auto",
        "load_draft": "always",
        "draft_p_min": 0.0,
        "draft_policy": "fixed",
        "log_format": "text",
        **overrides,
    }
    return Settings(**values).validate()


def process_engine(models: TinyModels, directory: Path, **overrides: Any) -> AsyncEngine:
    core = ProcessCore.start(settings(models, directory, **overrides))
    vocabulary = open_vocabulary(core.target_path)
    return AsyncEngine(core, vocabulary, GrammarCompiler(vocabulary, core.facts.info.vocab_size))


@pytest.fixture(scope="module")
def engine(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncEngine]:
    running = process_engine(tiny_models, tmp_path_factory.mktemp("core-process"), num_draft_tokens=16)
    yield running
    running.close()


async def _run(engine: AsyncEngine, name: str, prompt: str, params: SamplingParams, **kw: Any) -> Any:
    """(ids, text, finish reason, speculation counters) of one request."""
    ids = engine.vocabulary.tokenize(prompt)
    text, tokens, last = "", [], None
    async for out in engine.generate(name, ids, params, **kw):
        text += out.text_delta
        tokens += out.new_token_ids
        last = out
    assert last is not None and last.finished
    assert tokens == last.state.output_ids and text == last.state.text
    return tokens, text, last.state.finish_reason, last.state.stats.num_drafts


def test_every_requests_ids_of_a_step_come_in_one_message(engine: AsyncEngine) -> None:
    """Four requests decode together; each gets what it gets alone, in one message per step."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = SpeculationOptions(enabled=False)
    alone = [
        asyncio.run(_run(engine, f"alone-{i}", p, params, speculation=plain)) for i, p in enumerate(PROMPTS)
    ]
    messages: list[StepMessage] = []
    engine.step_observers.append(messages.append)

    async def together() -> list[Any]:
        return list(
            await asyncio.gather(
                *(_run(engine, f"b-{i}", p, params, speculation=plain) for i, p in enumerate(PROMPTS))
            )
        )

    try:
        assert asyncio.run(together()) == alone
    finally:
        engine.step_observers.remove(messages.append)
    outputs = sum(len(m.outputs) for m in messages)
    assert outputs >= 4 * 24 // 2  # (a step's first outputs may hold no text, but every id arrives)
    for m in messages:  # one message per step: each request once, and every request still running in it
        names = [o.request_id for o in m.outputs]
        assert len(set(names)) == len(names) >= m.num_running, m
    assert engine.num_running == 0 and engine.num_waiting == 0


def test_outputs_equal_the_engine_on_a_thread(
    engine: AsyncEngine, tiny_models: TinyModels, tmp_path: Path
) -> None:
    """Greedy with 16-token drafts, a stop string inside an accepted run, seeded sampling: the same ids, text
    and finish reasons whichever way the engine core is hosted."""
    built, _ = build_engine(settings(tiny_models, tmp_path, num_draft_tokens=16))
    on_thread = AsyncEngine(ThreadCore(built), built.target, built.grammars)
    try:
        first = asyncio.run(
            _run(on_thread, "probe", PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True))
        )
        stop = first[1][len(first[1]) // 2 :][:3]
        cases = [
            SamplingParams(max_tokens=40, ignore_eos=True),
            SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)),
            SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7),
        ]
        for i, params in enumerate(cases):
            speculation = SpeculationOptions(drafter="draft-model", num_draft_tokens=16)
            there = asyncio.run(_run(engine, f"p{i}", PROMPTS[0], params, speculation=speculation))
            here = asyncio.run(_run(on_thread, f"t{i}", PROMPTS[0], params, speculation=speculation))
            assert there[:3] == here[:3], params
            assert there[3] > 0  # it drafted
        stopped = asyncio.run(_run(engine, "stop", PROMPTS[0], cases[1]))
        assert stopped[2] == "stop" and stop not in stopped[1] and first[1].startswith(stopped[1] + stop)
    finally:
        on_thread.close()


def test_calls_run_between_steps(engine: AsyncEngine) -> None:
    async def go() -> None:
        await engine.set_speculation(False, 10)
        assert not engine.speculation_enabled and not engine.speculation_active()
        await engine.set_speculation(True, 10)
        snapshot = await engine.refresh()
        assert snapshot.speculation_enabled and "ngram" in snapshot.drafters
        assert snapshot.stats.generated_tokens > 0 and snapshot.stats.finished["length"] > 0
        assert await engine.held_block_hashes(10)  # the prefix cache kept the prompts above

    asyncio.run(go())


def test_a_refused_request_is_a_value_error_and_the_next_one_runs(engine: AsyncEngine) -> None:
    async def go() -> None:
        with pytest.raises(ValueError, match="context holds"):
            async for _ in engine.generate("too-long", list(range(1, 5000)), SamplingParams(max_tokens=4)):
                pass
        ids, *_ = await _run(engine, "after", PROMPTS[1], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(ids) == 4

    asyncio.run(go())


def test_a_load_failure_is_reported_without_a_live_child(tiny_models: TinyModels, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(EngineLoadError, match="loading the models failed"):
        ProcessCore.start(settings(tiny_models, tmp_path, target=str(broken), draft="none"))


def test_a_dead_engine_process_fails_the_requests_in_flight(tiny_models: TinyModels, tmp_path: Path) -> None:
    engine = process_engine(tiny_models, tmp_path, draft="none")
    deaths: list[BaseException] = []
    engine.on_death = deaths.append
    core = engine._core
    assert isinstance(core, ProcessCore)

    async def go() -> None:
        params = SamplingParams(max_tokens=3000, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="exited with status -9"):
            # Killed on the first output whatever its size: outputs merge while this reader is behind, so
            # waiting for exactly one id could miss the moment and let the request finish.
            async for _ in engine.generate("long", [1, 2, 3], params):
                if core.process.poll() is None:
                    os.kill(core.process.pid, signal.SIGKILL)
                    core.process.wait()
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("next", [1, 2, 3], params):
                pass

    try:
        asyncio.run(go())
        assert len(deaths) == 1 and engine.num_running == 0 and engine.num_waiting == 0
    finally:
        engine.close()


def test_the_engine_process_exits_when_its_api_process_closes_the_channel(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    core = ProcessCore.start(settings(tiny_models, tmp_path, draft="none"))
    pid = core.process.pid
    core._channel.close()  # as if the API process had died
    deadline = time.monotonic() + 10
    while core.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert core.process.returncode == 0, f"engine process {pid} still running"
