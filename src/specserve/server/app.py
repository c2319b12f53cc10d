"""The OpenAI-compatible HTTP application.

``create_app`` returns a FastAPI app whose lifespan loads the models on a background thread (so ``/health``
answers at once and ``/ready`` says 503 until the engine is built and calibrated), then serves requests
through an :class:`AsyncEngine`: model computation never runs on the event loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (and
``/v1/models/{id}``), ``GET /health`` (200 while the process serves), ``GET /ready``, and the debug endpoint
``GET /v1/internal/state`` → ``{"ready", "running", "waiting", "finished": {reason: count}}``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal, cast

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from specserve.backends.base import BackendError, ModelRuntime
from specserve.chat import ChatTemplateError, render_chat
from specserve.config import Settings
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.builder import BuildReport, build_engine
from specserve.engine.engine import RequestOutput, SpeculativeEngine
from specserve.engine.sequence import SpeculationOptions
from specserve.server import protocol as p
from specserve.server.errors import APIError, install_handlers, invalid_request, unavailable
from specserve.server.streaming import (
    ChunkFormat,
    EventStreamResponse,
    admit,
    collect,
    release_request,
    stream_events,
)

log = logging.getLogger("specserve.server")

EngineFactory = Callable[[Settings], SpeculativeEngine | tuple[SpeculativeEngine, BuildReport]]
FINISH_REASONS = ("stop", "length", "abort")
OFFLOAD_BYTES = 64 * 1024  # prompts in bodies larger than this are rendered and tokenized off the event loop


def served_model_id(settings: Settings) -> str:
    """The model name clients use: --served-model-name, else the target's catalog name or file stem."""
    if settings.served_model_name:
        return settings.served_model_name
    target = settings.target
    return Path(target).stem if target.endswith(".gguf") else target


class ServerState:
    """What the routes share: settings, the loading status and, once ready, the AsyncEngine."""

    def __init__(self, settings: Settings, factory: EngineFactory | SpeculativeEngine | None) -> None:
        self.settings = settings
        self.model_id = served_model_id(settings)
        self.created = int(time.time())
        self.timeout = settings.request_timeout or None
        self.status: Literal["loading", "ready", "failed", "stopped"] = "loading"
        self.reason = "the models are loading and calibrating"
        self.engine: AsyncEngine | None = None
        self.report: BuildReport | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self._factory = factory
        self._lock = threading.Lock()
        self._closed = False

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="specserve-loader", daemon=True).start()

    def _build(self) -> tuple[SpeculativeEngine, BuildReport | None]:
        factory = self._factory
        if isinstance(factory, SpeculativeEngine):
            return factory, None
        result = (factory or build_engine)(self.settings)
        return result if isinstance(result, tuple) else (result, None)

    def _load(self) -> None:
        try:
            engine, report = self._build()
        except Exception as exc:
            from specserve.models import ModelStoreError

            expected = isinstance(exc, BackendError | ModelStoreError | ValueError)  # no traceback needed
            log.error("loading the models failed: %s", exc, exc_info=not expected)
            self.reason = f"loading the models failed: {exc}"
            self.status = "failed"
            if self.on_failure is not None:
                self.on_failure(exc)
            return
        with self._lock:
            if self._closed:  # shut down while loading
                engine.close()
                return
            self.report = report
            self.engine = AsyncEngine(engine, self.settings.max_waiting)
            self.status, self.reason = "ready", "ready"
        log.info("ready: %s with drafters %s", self.model_id, ", ".join(engine.drafters) or "none")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            engine = self.engine
            if self.status == "ready":
                self.status, self.reason = "stopped", "the server is shutting down"
        if engine is not None:
            engine.shutdown()
            engine.engine.close()

    def require_engine(self) -> AsyncEngine:
        if self.status != "ready" or self.engine is None:
            raise unavailable(f"The server is not ready: {self.reason}.", f"server_{self.status}")
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_id, self.settings.target):
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_id}'.",
                param="model",
                code="model_not_found",
            )

    def speculation(
        self, engine: AsyncEngine, spec: p.SpeculativeRequest | None
    ) -> SpeculationOptions | None:
        if spec is None:
            return None
        loaded = list(engine.engine.drafters)
        if spec.drafter is not None and spec.drafter not in (*loaded, "auto", "none"):
            raise invalid_request(
                f"The drafter '{spec.drafter}' is not available; choose one of "
                f"{', '.join([*loaded, 'auto', 'none'])}.",
                "speculative.drafter",
                "unknown_drafter",
            )
        return spec.options()


# -- prompts --------------------------------------------------------------------------------------


def completion_prompt(runtime: ModelRuntime, request: p.CompletionRequest) -> list[int]:
    if isinstance(request.prompt, str):
        ids = runtime.tokenize(request.prompt)
    else:
        ids = request.prompt
        vocab = runtime.info.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise invalid_request(f"Token ids must be in [0, {vocab}).", "prompt")
    if not ids:
        raise invalid_request("The prompt is empty.", "prompt")
    return ids


def chat_prompt(runtime: ModelRuntime, request: p.ChatCompletionRequest) -> list[int]:
    try:
        text = render_chat(runtime, request.chat_messages())
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from None
    bos = runtime.special_token_text("bos")
    return runtime.tokenize(text, add_special=not (bos and text.startswith(bos)), parse_special=True)


async def prompt_ids(prepare: Callable[[], list[int]], body_size: int) -> list[int]:
    try:
        return await asyncio.to_thread(prepare) if body_size > OFFLOAD_BYTES else prepare()
    except UnicodeEncodeError:
        raise invalid_request("The prompt is not valid Unicode (it holds a lone surrogate).") from None


# -- generation -----------------------------------------------------------------------------------


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (at once when Content-Length says so)."""
    declared = request.headers.get("content-length", "")
    too_large = declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    if not too_large:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                too_large = True
                break
            chunks.append(chunk)
    if too_large:
        raise APIError(413, f"The request body exceeds {limit} bytes.", code="request_too_large")
    return b"".join(chunks)


async def generate(request: Request, chat: bool) -> Response:
    state: ServerState = request.app.state.server
    engine = state.require_engine()
    raw = await read_body(request, state.settings.max_request_bytes)
    runtime = engine.engine.target
    req: p.CompletionRequest | p.ChatCompletionRequest
    if chat:
        req = p.parse_request(raw, p.ChatCompletionRequest)
        prepare = partial(chat_prompt, runtime, req)
    else:
        req = p.parse_request(raw, p.CompletionRequest)
        prepare = partial(completion_prompt, runtime, req)
    state.check_model(req.model)
    ids = await prompt_ids(prepare, len(raw))
    params = req.sampling_params(
        len(ids), runtime.info.context_per_sequence, "messages" if chat else "prompt"
    )
    speculation = state.speculation(engine, req.speculative)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    fmt = ChunkFormat(chat, request_id, int(time.time()), state.model_id, req.include_usage)
    outputs = cast(
        AsyncGenerator[RequestOutput, None],
        engine.generate(request_id, ids, params, speculation, state.timeout),
    )
    first = await admit(outputs)
    if req.stream:
        return EventStreamResponse(
            stream_events(first, outputs, fmt), partial(release_request, first, outputs)
        )
    text, out = await collect(request, engine, request_id, first, outputs)
    return JSONResponse(fmt.response(text, out))


# -- routes ---------------------------------------------------------------------------------------

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await generate(request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await generate(request, chat=True)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    return p.ModelList(data=[p.ModelCard(id=state.model_id, created=state.created)]).model_dump()


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    state.check_model(model)
    return p.ModelCard(id=state.model_id, created=state.created).model_dump()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    if state.status != "ready" or state.engine is None:
        return JSONResponse({"status": state.status, "reason": state.reason}, status_code=503)
    report = state.report
    return JSONResponse(
        {
            "status": "ready",
            "model": state.model_id,
            "drafters": list(state.engine.engine.drafters),
            "notes": report.notes if report else [],
            "load_seconds": round(report.seconds, 3) if report else None,
        }
    )


@router.get("/v1/internal/state")
async def internal_state(request: Request) -> dict[str, Any]:
    """Debugging and tests: sequences decoding, requests waiting, finished requests by reason."""
    state: ServerState = request.app.state.server
    engine = state.engine
    if engine is None:
        return {"ready": False, "running": 0, "waiting": 0, "finished": dict.fromkeys(FINISH_REASONS, 0)}
    finished = engine.engine.stats.finished
    return {
        "ready": state.status == "ready",
        "running": engine.num_running,
        "waiting": engine.num_waiting,
        "finished": {r: finished.get(r, 0) for r in FINISH_REASONS},
    }


def create_app(
    settings: Settings, engine_factory: EngineFactory | SpeculativeEngine | None = None
) -> FastAPI:
    """The application; ``engine_factory`` (a builder or a prebuilt engine) replaces ``build_engine``."""
    state = ServerState(settings, engine_factory)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        try:
            yield
        finally:
            await asyncio.to_thread(state.close)

    app = FastAPI(title="specserve", summary="Speculative decoding, OpenAI-compatible", lifespan=lifespan)
    app.state.server = state
    install_handlers(app)
    app.include_router(router)
    return app
