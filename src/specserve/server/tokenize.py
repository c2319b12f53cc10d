"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``: the target's tokenizer over
HTTP (clients count tokens and build prompts with it; lm-eval's remote tokenizer uses all three). A chat
body (``messages``) is tokenized as the chat endpoint would."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import Field

from specserve.backends.base import Vocabulary
from specserve.backends.base import detokenize as token_text  # the route below is called detokenize
from specserve.chat import ChatTemplateError, chat_prompt_ids
from specserve.engine.async_engine import AsyncEngine
from specserve.server import chat_request as c
from specserve.server.errors import invalid_request
from specserve.server.request_body import read_model
from specserve.server.state import ServerState
from specserve.server.strict import StrictModel

router = APIRouter()


class TokenizeRequest(StrictModel):
    """Either ``prompt`` (text) or ``messages`` (a chat and the ``tools`` offered, rendered as for chat)."""

    model: str | None = Field(None, max_length=512)
    prompt: str | None = None
    messages: list[c.ChatMessage] | None = None
    tools: list[c.ToolDefinition] | None = Field(None, max_length=128)
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = Field(None, max_length=512)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=1_000_000)


ModelT = TypeVar("ModelT", bound=StrictModel)


async def _parse(request: Request, schema: type[ModelT]) -> tuple[AsyncEngine, ModelT]:
    """The engine and the validated body (limits and errors as on /v1; the model named must be ours)."""
    state: ServerState = request.app.state.server
    engine = state.require_engine()
    req = await read_model(request, schema, state.settings.max_request_bytes, state.settings.client_timeout)
    state.check_model(getattr(req, "model", None))
    return engine, req


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    engine, req = await _parse(request, TokenizeRequest)
    vocabulary = engine.vocabulary
    if (req.prompt is None) == (not req.messages):
        raise invalid_request("Give either 'prompt' or 'messages'.", "prompt")
    try:  # off the event loop: a body may hold megabytes of text
        ids = await asyncio.to_thread(_token_ids, vocabulary, req)
    except UnicodeEncodeError:
        raise invalid_request("The text is not valid Unicode (it holds a lone surrogate).") from None
    result: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": engine.info.context_per_sequence,
        "tokens": ids,
    }
    if req.return_token_strs:
        result["token_strs"] = [vocabulary.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
    return result


def _token_ids(vocabulary: Vocabulary, req: TokenizeRequest) -> list[int]:
    if req.prompt is not None:
        return vocabulary.tokenize(req.prompt, add_special=req.add_special_tokens)
    chat = c.ChatCompletionRequest.model_construct(messages=req.messages, tools=req.tools, tool_choice=None)
    try:
        return chat_prompt_ids(vocabulary, chat.chat_messages(), chat.template_tools())
    except ChatTemplateError as exc:
        raise invalid_request(str(exc), "messages") from None


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    engine, req = await _parse(request, DetokenizeRequest)
    vocab = engine.info.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise invalid_request(f"Token ids must be in [0, {vocab}).", "tokens")
    return {"prompt": token_text(engine.vocabulary, req.tokens)}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """What vLLM's endpoint gives a remote tokenizer: the special tokens, the chat template, the context."""
    state: ServerState = request.app.state.server
    engine = state.require_engine()
    vocabulary = engine.vocabulary
    bos, eos = vocabulary.special_token_text("bos"), vocabulary.special_token_text("eos")
    adds_bos = vocabulary.tokenize("a", add_special=True) != vocabulary.tokenize("a", add_special=False)
    return {
        "tokenizer_class": "GGUF",
        "bos_token": bos or None,
        "eos_token": eos or None,
        "pad_token": None,
        "add_bos_token": adds_bos,
        "chat_template": vocabulary.chat_template(),
        "model_max_length": engine.info.context_per_sequence,
        "vocab_size": engine.info.vocab_size,
    }
