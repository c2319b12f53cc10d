"""The OpenAI-compatible HTTP application.

``create_app`` returns a FastAPI app whose lifespan loads the models on a background thread (so ``/health``
answers at once and ``/ready`` says 503 until the engine is built and calibrated), then serves requests
through an :class:`AsyncEngine`: model computation never runs on the event loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (and ``GET`` /
``DELETE /v1/responses/{id}``: server/responses_route.py; features and their semantics: docs/API.md),
``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /tokenize``, ``/detokenize`` and ``GET /tokenizer_info``
(server/tokenize.py), ``GET /health`` (200 while the process serves), ``GET /ready``, and the debug endpoint
``GET /v1/internal/state`` → ``{"ready", "running", "waiting", "finished": {reason: count}}``. Operations
(metrics, logs, access control, the speculation switch) come from ``middleware``, ``auth`` and ``admin``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, cast

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from specserve.config import Settings
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.output_processor import RequestOutput
from specserve.request import GrammarSpec, SamplingParams
from specserve.server import chat_request as c
from specserve.server import protocol as p
from specserve.server import responses as r
from specserve.server.admin import router as ops_router
from specserve.server.chunks import ChunkFormat
from specserve.server.errors import install_handlers, invalid_request
from specserve.server.middleware import OpsMiddleware, current_record
from specserve.server.openapi import install_openapi
from specserve.server.prompts import chat_prompt, completion_prompts, logged_prompt, prompt_ids, prompt_output
from specserve.server.request_body import read_body
from specserve.server.responses_route import ChatAPI, responses_router
from specserve.server.state import EngineFactory, ServerState
from specserve.server.streaming import (
    Choice,
    EventStreamResponse,
    admit,
    collect,
    release_choices,
    stream_events,
)
from specserve.server.tokenize import router as tokenize_router
from specserve.server.tool_stream import ToolParsing
from specserve.structured.grammar import GrammarError

log = logging.getLogger("specserve.server")

FINISH_REASONS = ("stop", "length", "abort")


# -- generation -----------------------------------------------------------------------------------


async def generate(request: Request, chat: bool, api: ChatAPI | None = None) -> Response:
    """``api``: another API on the chat path (``/v1/responses``) with its own body and response."""
    state: ServerState = request.app.state.server
    engine = state.require_engine()
    raw = await read_body(request, state.settings.max_request_bytes, state.settings.client_timeout)
    vocabulary, info = engine.vocabulary, engine.info
    req: p.CompletionRequest | c.ChatCompletionRequest
    tools: ToolParsing | None = None
    if chat:
        req = p.parse_request(raw, c.ChatCompletionRequest) if api is None else api.parse(raw)
        prepare = partial(chat_prompt, vocabulary, req)
    else:
        req = p.parse_request(raw, p.CompletionRequest)
        prepare = partial(completion_prompts, vocabulary, info.vocab_size, req)
    state.check_model(req.model)
    prompts = await prompt_ids(prepare, len(raw))
    prompt_field = "messages" if chat else "prompt"
    each = [req.sampling_params(len(ids), info.context_per_sequence, prompt_field) for ids in prompts]
    params = each[0]  # the prompts differ only in their default max_tokens
    if (field := params.unknown_token_ids(info.vocab_size)) is not None:  # a 400 before a stream starts
        raise invalid_request(f"Token ids in {field} must be in [0, {info.vocab_size}).", field)
    if params.grammar is not None:
        await compile_grammar(engine, params.grammar)
    if isinstance(req, c.ChatCompletionRequest):
        tools = req.tool_parsing(params.grammar)
    speculation = state.speculation(engine, req.speculative)
    salt = state.access.cache_salt(request.headers.get("authorization"), req.cache_salt)
    request_id = api.id if api is not None else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    record = current_record()
    if record is not None:
        record.completion_id, record.stream = request_id, req.stream
        if state.settings.log_prompts:
            record.prompt = logged_prompt(req)
    fmt = ChunkFormat(
        chat, request_id, int(time.time()), state.model_id, req.include_usage, vocabulary.token_bytes,
        params.logprobs is not None, prompt_output(vocabulary, req, prompts), tools, req.n,
    )  # fmt: skip
    start = partial(engine.generate, speculation=speculation, timeout=state.timeout, cache_salt=salt)
    choices = await start_choices(start, request_id, prompts, each, req.n)
    if record is not None:
        record.watch(choices[0].first)
    if api is not None:
        return await api.respond(request, engine, choices, fmt)
    if req.stream:
        return EventStreamResponse(
            stream_events(choices, fmt, state.settings.stream_keepalive),
            partial(release_choices, choices),
            stall_timeout=state.settings.client_timeout * 3,
        )
    return JSONResponse(fmt.response(await collect(request, engine, choices)))


async def start_choices(
    start: Callable[..., AsyncIterator[RequestOutput]],
    request_id: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    n: int,
) -> list[Choice]:
    """Admit ``n`` choices of each prompt (choice ``i * n + j`` is prompt ``i``'s ``j``-th). A prompt's first
    choice runs its prefill alone; its others then find the prompt's KV in the prefix cache. Each choice has
    its own seed (``seed + j`` when the request gave one)."""
    choices: list[Choice] = []
    try:
        for i, (ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
            for j in range(n):
                index = i * n + j
                choice_id = request_id if n * len(prompts) == 1 else f"{request_id}-{index}"
                seed = None if prompt_params.seed is None else (prompt_params.seed + j) % 2**63
                outputs = cast(
                    AsyncGenerator[RequestOutput, None],
                    start(choice_id, ids, dataclasses.replace(prompt_params, seed=seed)),
                )
                choices.append(Choice(index, choice_id, await admit(outputs), outputs))
                if j == 0 and n > 1:
                    await asyncio.wait({choices[-1].first})
    except BaseException:
        await release_choices(choices)
        raise
    return choices


async def compile_grammar(engine: AsyncEngine, spec: GrammarSpec) -> None:
    """Compile the request's grammar off the event loop (a large schema takes a while; the engine then
    copies the cached result); a grammar that does not compile is a 400."""
    try:
        await asyncio.to_thread(engine.grammars.compile, spec)
    except GrammarError as exc:  # a tool's parameters are a grammar too (tool_choice's)
        raise invalid_request(str(exc), "tools" if spec.triggers else "response_format") from None


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
    return r.ModelList(data=[r.ModelCard(id=state.model_id, created=state.created)]).model_dump()


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    state.check_model(model)
    return r.ModelCard(id=state.model_id, created=state.created).model_dump()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.server
    if state.status != "ready" or state.engine is None:
        return JSONResponse({"status": state.status, "reason": state.reason}, status_code=503)
    await state.refresh_engine_state()
    report = state.report
    reasons = state.degraded_reasons()
    target = state.engine.info
    return JSONResponse(
        {
            "status": "ready",
            "model": state.model_id,
            "drafters": state.engine.loaded_drafters(),
            "speculation": state.engine.speculation_enabled,
            "degraded": bool(reasons),
            "degraded_reasons": reasons,
            "notes": report.notes if report else [],
            "exactness": {"mode": target.exactness, "check": target.exactness_note},
            "runtime": {"description": target.description, "logits": target.logits_device},
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
    await state.refresh_engine_state()
    finished = engine.stats.finished
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
    app.add_middleware(OpsMiddleware, state=state)
    app.include_router(router)
    app.include_router(ops_router)
    app.include_router(tokenize_router)
    app.include_router(responses_router(generate, settings))
    install_openapi(app)
    return app
