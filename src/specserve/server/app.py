"""The OpenAI-compatible HTTP application.

``create_app`` returns a FastAPI app whose lifespan loads the models on a background thread (so ``/health``
answers at once and ``/ready`` says 503 until the engine is built and calibrated), then serves requests
through an :class:`AsyncEngine`: model computation never runs on the event loop.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (features and their semantics:
docs/API.md), ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /tokenize`` and ``/detokenize``
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

from specserve.backends.base import Vocabulary, detokenize
from specserve.chat import ChatTemplateError, chat_prompt_ids
from specserve.config import Settings
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.engine import RequestOutput, SpeculativeEngine
from specserve.request import GrammarSpec, SamplingParams
from specserve.server import chat_request as c
from specserve.server import protocol as p
from specserve.server import responses as r
from specserve.server.admin import router as ops_router
from specserve.server.chunks import ChunkFormat
from specserve.server.errors import install_handlers, invalid_request
from specserve.server.middleware import OpsMiddleware, current_record
from specserve.server.openapi import install_openapi
from specserve.server.request_body import read_body
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
OFFLOAD_BYTES = 64 * 1024  # prompts in bodies larger than this are rendered and tokenized off the event loop


# -- prompts --------------------------------------------------------------------------------------


def completion_prompt(vocabulary: Vocabulary, vocab: int, request: p.CompletionRequest) -> list[int]:
    if isinstance(request.prompt, str):
        ids = vocabulary.tokenize(request.prompt, add_special=request.suffix is None)
    else:
        ids = request.prompt
        if any(not 0 <= t < vocab for t in ids):
            raise invalid_request(f"Token ids must be in [0, {vocab}).", "prompt")
    if request.suffix is not None:
        ids = fill_in_the_middle(vocabulary, ids, request.suffix)
    if request.echo and request.logprobs is not None:
        raise invalid_request("echo with logprobs (the prompt's logprobs) is not supported.", "echo")
    if not ids:
        raise invalid_request("The prompt is empty.", "prompt")
    return ids


FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
"""The fill-in-the-middle control tokens of Qwen2.5-Coder (and StarCoder-style models)."""


def fill_in_the_middle(vocabulary: Vocabulary, prefix: list[int], suffix: str) -> list[int]:
    """``suffix``: the prompt is the text before the insertion point, the model writes what goes between."""
    marks = [vocabulary.tokenize(t, add_special=False, parse_special=True) for t in FIM_TOKENS]
    if any(len(m) != 1 or not vocabulary.is_control(m[0]) for m in marks):
        raise invalid_request(
            "This model has no fill-in-the-middle tokens; 'suffix' is not supported.", "suffix"
        )
    text = vocabulary.tokenize(suffix, add_special=False) if suffix else []
    return [*marks[0], *prefix, *marks[1], *text, *marks[2]]


def chat_prompt(vocabulary: Vocabulary, request: c.ChatCompletionRequest) -> list[int]:
    try:
        return chat_prompt_ids(vocabulary, request.chat_messages(), request.template_tools())
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from None


async def prompt_ids(prepare: Callable[[], list[int]], body_size: int) -> list[int]:
    try:
        return await asyncio.to_thread(prepare) if body_size > OFFLOAD_BYTES else prepare()
    except UnicodeEncodeError:
        raise invalid_request("The prompt is not valid Unicode (it holds a lone surrogate).") from None


# -- generation -----------------------------------------------------------------------------------


async def generate(request: Request, chat: bool) -> Response:
    state: ServerState = request.app.state.server
    engine = state.require_engine()
    raw = await read_body(request, state.settings.max_request_bytes, state.settings.client_timeout)
    vocabulary, info = engine.vocabulary, engine.info
    req: p.CompletionRequest | c.ChatCompletionRequest
    tools: ToolParsing | None = None
    if chat:
        req = p.parse_request(raw, c.ChatCompletionRequest)
        prepare = partial(chat_prompt, vocabulary, req)
    else:
        req = p.parse_request(raw, p.CompletionRequest)
        prepare = partial(completion_prompt, vocabulary, info.vocab_size, req)
    state.check_model(req.model)
    ids = await prompt_ids(prepare, len(raw))
    params = req.sampling_params(len(ids), info.context_per_sequence, "messages" if chat else "prompt")
    if (field := params.unknown_token_ids(info.vocab_size)) is not None:  # a 400 before a stream starts
        raise invalid_request(f"Token ids in {field} must be in [0, {info.vocab_size}).", field)
    if params.grammar is not None:
        await compile_grammar(engine, params.grammar)
    if isinstance(req, c.ChatCompletionRequest):
        tools = req.tool_parsing(params.grammar)
    speculation = state.speculation(engine, req.speculative)
    salt = state.access.cache_salt(request.headers.get("authorization"), req.cache_salt)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    record = current_record()
    if record is not None:
        record.completion_id, record.stream = request_id, req.stream
        if state.settings.log_prompts:
            record.prompt = req.chat_messages() if isinstance(req, c.ChatCompletionRequest) else req.prompt
    echo = echo_text(vocabulary, req) if isinstance(req, p.CompletionRequest) and req.echo else ""
    token_bytes = engine.vocabulary.token_bytes if params.logprobs is not None else None
    fmt = ChunkFormat(
        chat, request_id, int(time.time()), state.model_id, req.include_usage, token_bytes, echo, tools
    )
    start = partial(engine.generate, speculation=speculation, timeout=state.timeout, cache_salt=salt)
    choices = await start_choices(start, request_id, ids, params, req.n)
    if record is not None:
        record.watch(choices[0].first)
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
    ids: list[int],
    params: SamplingParams,
    n: int,
) -> list[Choice]:
    """Admit the request's ``n`` choices. The first runs its prefill alone; the others then find the prompt's
    KV in the prefix cache. Each choice has its own seed (``seed + i`` when the request gave one)."""
    choices: list[Choice] = []
    try:
        for i in range(n):
            choice_id = request_id if n == 1 else f"{request_id}-{i}"
            seed = None if params.seed is None else (params.seed + i) % 2**63
            outputs = cast(
                AsyncGenerator[RequestOutput, None],
                start(choice_id, ids, dataclasses.replace(params, seed=seed)),
            )
            choices.append(Choice(i, choice_id, await admit(outputs), outputs))
            if i == 0 and n > 1:
                await asyncio.wait({choices[0].first})
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


def echo_text(vocabulary: Vocabulary, request: p.CompletionRequest) -> str:
    if isinstance(request.prompt, str):
        return request.prompt
    return detokenize(vocabulary, request.prompt)


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
    install_openapi(app)
    return app
