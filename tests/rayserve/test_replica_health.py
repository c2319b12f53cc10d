"""An engine replica's health check and routing stats, on a real engine outside Ray."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from specserve.engine.async_engine import EngineDeadError
from specserve.engine.builder import build_engine
from specserve.engine.engine import SpeculativeEngine
from specserve.rayserve.replica import EngineReplica
from specserve.request import SamplingParams
from specserve.server.app import create_app
from support.tiny_models import TinyModels

from .cluster import tiny_settings


def replica_outside_ray(
    models: TinyModels, directory: Path, engine: SpeculativeEngine | None = None
) -> EngineReplica:
    """EngineReplica.__init__ less the Serve context lookup (it only names the replica); with ``engine``, that
    engine on a thread, else the engine core in its own process as in a real replica."""
    settings = tiny_settings(models, directory, draft="none")
    replica = EngineReplica.__new__(EngineReplica)
    replica.app = create_app(settings, None if engine is None else lambda _: engine)
    replica.state = replica.app.state.server
    replica.state.load()
    replica.replica_id = "test"
    return replica


def one_request(replica: EngineReplica, after_first: Callable[[], None] = lambda: None) -> None:
    engine = replica.state.engine
    assert engine is not None

    async def go() -> None:
        # Nearly the whole context, so the kill lands long before the last token; the hook runs on the first
        # output whatever its size (outputs merge while this reader is behind, so it may carry several ids).
        params = SamplingParams(max_tokens=4000, ignore_eos=True)
        first = True
        async for _ in engine.generate("r1", [1, 2, 3, 4], params):
            if first:
                first = False
                after_first()

    asyncio.run(go())


def test_a_replica_whose_engine_thread_died_reports_unhealthy(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    built, _ = build_engine(tiny_settings(tiny_models, tmp_path, draft="none"))
    replica = replica_outside_ray(tiny_models, tmp_path, built)
    try:
        replica.check_health()

        def broken_step() -> list[Any]:
            raise RuntimeError("injected engine failure")

        built.step = broken_step  # type: ignore[method-assign]
        with pytest.raises(EngineDeadError):
            one_request(replica)
        with pytest.raises(RuntimeError, match="engine of replica test failed"):
            replica.check_health()  # Serve replaces a replica whose check fails
    finally:
        replica.state.close()


def test_a_replica_whose_engine_process_died_reports_unhealthy(
    tiny_models: TinyModels, tmp_path: Path
) -> None:
    replica = replica_outside_ray(tiny_models, tmp_path)
    try:
        replica.check_health()
        assert replica.state.engine is not None
        child = replica.state.engine.engine_pid
        assert child is not None
        with pytest.raises(EngineDeadError, match="exited with status -9"):
            one_request(replica, lambda: os.kill(child, signal.SIGKILL))  # mid-request
        with pytest.raises(RuntimeError, match="engine of replica test failed"):
            replica.check_health()
    finally:
        replica.state.close()
