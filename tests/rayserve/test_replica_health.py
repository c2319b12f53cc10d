"""An engine replica's health check and routing stats, on a real engine outside Ray."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from specserve.engine.async_engine import EngineDeadError
from specserve.engine.builder import build_engine
from specserve.engine.prefix_cache import block_hashes, routing_key
from specserve.rayserve.replica import EngineReplica
from specserve.request import SamplingParams
from specserve.server.app import create_app
from support.tiny_models import TinyModels

from .cluster import tiny_settings


def replica_outside_ray(models: TinyModels, directory: Path) -> EngineReplica:
    """EngineReplica.__init__ less the Serve context lookup (it only names the replica)."""
    settings = tiny_settings(models, directory, draft="none")
    built = build_engine(settings)
    replica = EngineReplica.__new__(EngineReplica)
    replica.app = create_app(settings, lambda _: built)
    replica.state = replica.app.state.server
    replica.state.load()
    replica.replica_id = "test"
    return replica


def test_a_replica_whose_engine_died_reports_unhealthy(tiny_models: TinyModels, tmp_path: Path) -> None:
    replica = replica_outside_ray(tiny_models, tmp_path)
    try:
        replica.check_health()
        engine = replica.state.engine
        assert engine is not None

        def broken_observer(*_: object) -> None:
            raise RuntimeError("injected engine failure")

        engine.step_observers.append(broken_observer)

        async def one_request() -> None:
            async for _ in engine.generate("r1", [1, 2, 3, 4], SamplingParams(max_tokens=4)):
                pass

        with pytest.raises(EngineDeadError):
            asyncio.run(one_request())
        with pytest.raises(RuntimeError, match="engine of replica test failed"):
            replica.check_health()  # Serve replaces a replica whose check fails
    finally:
        replica.state.close()


def test_routing_stats_report_the_prefix_caches_block_hashes(tiny_models: TinyModels, tmp_path: Path) -> None:
    replica = replica_outside_ray(tiny_models, tmp_path)
    try:
        engine = replica.state.engine
        assert engine is not None
        prompt = list(range(10, 60))  # 3 whole blocks

        async def go() -> dict[str, object]:
            async for _ in engine.generate("r1", prompt, SamplingParams(max_tokens=2)):
                pass
            return await replica.record_routing_stats()

        stats = asyncio.run(go())
        expected = [routing_key(h) for h in block_hashes(prompt, "")]
        assert set(expected) <= set(stats["block_hashes"])  # type: ignore[call-overload]
        assert stats["replica"] == "test" and stats["running"] == 0
    finally:
        replica.state.close()
