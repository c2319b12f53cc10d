"""OpenAI response schemas for ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` (the bodies
are built in server/streaming.py; these models validate them and document them in the OpenAPI schema)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel

from specserve.engine.output_processor import RequestState


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, requests: Sequence[RequestState], n: int = 1) -> Usage:
        """The usage of a request's choices (``n`` per prompt, in order): each prompt once, every choice's
        completion."""
        firsts = requests[::n]
        prompt, completion = sum(len(s.prompt_ids) for s in firsts), sum(len(s.output_ids) for s in requests)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(s.cached_tokens for s in firsts)),
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` when asked."""
    finish_reason: str | None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    """vLLM's: per prompt token (the first null), ``{token id: {"logprob", "rank", "decoded_token"}}``."""


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative: dict[str, Any]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str
    """The arguments as JSON text (OpenAI's form)."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` when asked."""
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: dict[str, Any]
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    """vLLM's, as on a completion's choice."""


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
