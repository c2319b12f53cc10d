"""Operations endpoints: ``GET /metrics`` and the speculation switch ``GET|POST /admin/speculation``.

The switch changes the engine's options on the engine thread, between two steps: running requests
continue as plain decoding from their next step, nothing is lost, and turning it back on resumes drafting
(drafters catch up on the tokens they missed). Access to ``/admin/*`` is checked by the middleware.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response

from specserve.engine.async_engine import AsyncEngine, EngineDeadError
from specserve.engine.core import traced_heap
from specserve.server.errors import unavailable
from specserve.server.request_body import read_model

if TYPE_CHECKING:
    from specserve.server.state import ServerState

log = logging.getLogger("specserve.server")

SWITCH_TIMEOUT_S = 10.0
HEAP_TIMEOUT_S = 60.0

router = APIRouter()


class SpeculationSwitch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    enabled: bool


def speculation_status(state: ServerState, engine: AsyncEngine) -> dict[str, Any]:
    reasons = state.degraded_reasons()
    loaded = engine.loaded_drafters()
    return {
        "enabled": engine.speculation_enabled,
        "active": engine.speculation_active(),
        "drafters": [name for name in engine.configured_drafters if name in loaded],
        "degraded": bool(reasons),
        "degraded_reasons": reasons,
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body, content_type = await state.metrics.scrape()
    return Response(body, media_type=content_type)


@router.get("/admin/heap")
async def heap(request: Request) -> dict[str, Any]:
    """Python heap figures for leak hunting: what ``tracemalloc`` traces, if the server was started with
    ``PYTHONTRACEMALLOC=1`` (the soak test does), and the largest allocation sites by line; with the engine
    in its own process, that process's under ``engine``."""
    state: ServerState = request.app.state.server
    figures = await asyncio.to_thread(traced_heap)  # a snapshot takes a while: off the event loop
    if state.engine is not None and state.engine.engine_pid is not None:
        try:
            figures["engine"] = await state.engine.engine_heap(HEAP_TIMEOUT_S)
        except (EngineDeadError, TimeoutError, RuntimeError) as exc:
            figures["engine"] = {"tracing": False, "error": str(exc)}
    return figures


@router.get("/admin/speculation")
async def get_speculation(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine = state.require_engine()
    await state.refresh_engine_state()
    return speculation_status(state, engine)


@router.post("/admin/speculation")
async def set_speculation(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    engine = state.require_engine()
    # The same limits and parser as /v1: JSON only, bounded size and time, no recursion errors.
    settings = state.settings
    switch = await read_model(request, SpeculationSwitch, settings.max_request_bytes, settings.client_timeout)

    try:  # applied on the engine thread between two steps: no step sees half a change
        await engine.set_speculation(switch.enabled, SWITCH_TIMEOUT_S)
    except (TimeoutError, EngineDeadError):
        raise unavailable(
            "The engine did not apply the switch; see the server log.", "engine_stopped"
        ) from None
    log.warning("speculation switched %s by an admin request", "on" if switch.enabled else "off")
    return speculation_status(state, engine)
