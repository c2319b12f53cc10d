"""The engine deployment: one replica is one specserve engine serving the single-process application.

A replica starts its engine in ``__init__`` (the engine core in a process of its own, as ``specserve serve``
runs it) and waits until the models are loaded and calibrated, so Serve sends it traffic only once it can
serve (Serve routes to a replica after its constructor and a first ``check_health``). Requests arrive as
:class:`HTTPCall` objects and run through the same FastAPI app ``specserve serve`` runs; every response names
the replica in ``X-Specserve-Replica``. The router learns what each replica's prefix cache holds from
``record_routing_stats``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from specserve.config_sources import with_secrets_from_env
from specserve.engine.prefix_cache import routing_key
from specserve.logging import configure_logging
from specserve.rayserve import REPLICA_HEADER
from specserve.rayserve.asgi_bridge import HTTPCall, Part, run_asgi
from specserve.server.app import create_app
from specserve.server.state import ServerState

log = logging.getLogger("specserve.rayserve")

MAX_REPORTED_HASHES = 32768
"""Block hashes one replica reports per routing-stats period (8 bytes each; 512 K tokens of prefixes)."""
STATS_TIMEOUT_S = 5.0


class EngineReplica:
    """A Serve deployment class (decorated in :mod:`specserve.rayserve.app`)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from ray import serve

        self.settings = with_secrets_from_env(settings)
        configure_logging(self.settings.log_level, self.settings.log_format)
        self.app = create_app(self.settings)
        self.state: ServerState = self.app.state.server
        self.state.load()  # load and calibrate before taking traffic
        if self.state.status != "ready":
            raise RuntimeError(self.state.reason)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._headers = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        log.info("replica %s ready", self.replica_id)

    async def handle(self, call: HTTPCall) -> AsyncIterator[Part]:
        async for part in run_asgi(self.app, call, self._headers):
            yield part

    def check_health(self) -> None:
        """Serve replaces a replica whose check fails: a dead engine never serves again."""
        engine = self.state.engine
        if engine is None or engine.error is not None or self.state.status != "ready":
            raise RuntimeError(f"the engine of replica {self.replica_id} failed: {self.state.reason}")

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads: the prefix cache's block hashes and the queue."""
        engine = self.state.engine
        held = await engine.held_block_hashes(STATS_TIMEOUT_S) if engine is not None else []
        return {
            "replica": self.replica_id,
            "block_hashes": [routing_key(h) for h in held[-MAX_REPORTED_HASHES:]],
            "running": engine.num_running if engine is not None else 0,
            "waiting": engine.num_waiting if engine is not None else 0,
        }

    def __del__(self) -> None:
        # Serve calls this on a graceful stop, after in-flight requests drained: free the models.
        state = getattr(self, "state", None)
        if state is not None:
            state.close()
