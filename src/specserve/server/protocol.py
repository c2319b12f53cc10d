"""OpenAI request and response schemas for ``/v1/completions`` and ``/v1/chat/completions``.

Requests are validated strictly (no string-to-number coercion, no NaN; ``null`` means the default) once,
here. Supported fields:

* ``model``: optional; the served model id (or the ``--target`` value), anything else is a 404;
* ``prompt``: a string, a list of one string, or token ids (several prompts are a 400); ``messages`` with
  roles system / developer / user / assistant and string (or text-part) content;
* ``max_tokens`` (chat: also ``max_completion_tokens``): default is the room left in the context;
  prompt + max_tokens beyond the context is a 400 naming both numbers;
* ``temperature`` (0..2, default 1; 0 is greedy), ``top_p``, ``top_k`` (0 or -1 disables), ``min_p``,
  ``seed``, ``stop`` (a string or up to ``MAX_STOP_STRINGS`` strings of at most ``MAX_STOP_LENGTH``
  characters: more than OpenAI's 4), ``stream``, ``stream_options.include_usage``, ``n`` (1 only), ``user``;
* extensions: ``ignore_eos`` and ``speculative: {enabled, drafter, num_draft_tokens}``, which overrides the
  server's speculation default for the request (an unknown drafter is a 400).

OpenAI fields this server does not implement (penalties, logit_bias, logprobs, tools ...) are accepted only
at their neutral value and rejected otherwise; any other unknown field is ignored.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from specserve.request import SamplingParams
from specserve.sequence import Sequence, SpeculationOptions
from specserve.server.errors import from_validation, invalid_request
from specserve.server.request_body import json_object

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256

# Known OpenAI (and vLLM) fields without an implementation here, with the values that mean "not used".
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "use_beam_search": (None, False),
}


def check_unsupported(body: dict[str, Any]) -> None:
    """Reject a known but unimplemented field that is set to something other than its neutral value."""
    for name, neutral in NEUTRAL_VALUES.items():
        if name in body and not any(_same(body[name], value) for value in neutral):
            raise invalid_request(f"'{name}' is not supported by this server; omit it.", name, "unsupported")


def _same(value: Any, neutral: Any) -> bool:
    """Equality that keeps booleans apart from numbers (``0 == False`` in Python)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    return bool(value == neutral)


def _integral(value: Any) -> Any:
    """JSON has one number type: ``1.0`` is the integer 1 (as JSON Schema says), ``1.5`` is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# What the validators accept, for the OpenAPI document (the annotations say what they produce).
STOP_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH},
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH},
            "maxItems": MAX_STOP_STRINGS,
        },
    ]
}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1},
    ]
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, value: Any) -> Any:
        """``"field": null`` means the default, as many OpenAI clients send it; an integral number is an int
        wherever an int is expected (strict mode alone would refuse ``1.0``)."""
        if not isinstance(value, dict):
            return value
        ints = cls._int_fields()
        return {k: _integral(v) if k in ints else v for k, v in value.items() if v is not None}

    @classmethod
    def _int_fields(cls) -> frozenset[str]:
        return frozenset(
            name
            for name, f in cls.model_fields.items()
            if f.annotation is int or int in typing.get_args(f.annotation)
        )


class SpeculativeRequest(_Strict):
    """Extension: per-request speculation (unset fields keep the server default)."""

    enabled: bool | None = None
    drafter: str | None = Field(None, min_length=1, max_length=64)
    num_draft_tokens: int | None = Field(None, ge=0, le=64)

    def options(self) -> SpeculationOptions:
        return SpeculationOptions(self.enabled, self.drafter, self.num_draft_tokens)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, max_length=512)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Annotated[list[str], WithJsonSchema(STOP_SCHEMA)] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, WithJsonSchema({"type": "integer", "minimum": 1, "maximum": 1})] = 1
    user: str | None = None
    ignore_eos: bool = False
    speculative: SpeculativeRequest | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    """vLLM's field: requests reuse each other's cached prompt KV only if their salts are equal."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        return [] if value is None else [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
        if any(not s or len(s) > MAX_STOP_LENGTH for s in value):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_LENGTH} characters")
        return value

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"only n=1 is supported (got {value}); send one request per completion")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The requested completion length and the name of the field that set it."""
        return self.max_tokens, "max_tokens"

    def sampling_params(self, num_prompt_tokens: int, context: int, prompt_param: str) -> SamplingParams:
        """Sampling parameters, after checking that prompt and completion fit the context."""
        room = context - num_prompt_tokens
        if room < 1:
            raise invalid_request(
                f"The prompt has {num_prompt_tokens} tokens, but this model's context holds {context} tokens "
                "(including at least one generated token). Please shorten the prompt.",
                prompt_param,
                "context_length_exceeded",
            )
        max_tokens, param = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = room  # like vLLM: whatever room the context leaves
        elif num_prompt_tokens + max_tokens > context:
            raise invalid_request(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                f"for the completion). Please reduce the prompt or {param}.",
                param,
                "context_length_exceeded",
            )
        try:
            return SamplingParams(
                temperature=self.temperature,
                top_k=max(self.top_k, 0),
                top_p=self.top_p,
                min_p=self.min_p,
                seed=self.seed,
                max_tokens=max_tokens,
                stop=tuple(self.stop),
                ignore_eos=self.ignore_eos,
            )
        except ValueError as exc:
            raise invalid_request(str(exc)) from None


class CompletionRequest(SamplingRequest):
    prompt: Annotated[str | list[int], WithJsonSchema(PROMPT_SCHEMA)]
    """One prompt: a string (a list of one string is unwrapped) or token ids (a list of one list likewise)."""

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
            if len(value) != 1:
                raise ValueError(f"{len(value)} prompts were given; this server takes one prompt per request")
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("the prompt must not be empty")
        if not isinstance(value, str | list):
            raise ValueError("must be a string, a list of one string, or a list of token ids")
        return [_integral(v) for v in value] if isinstance(value, list) else value


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_content(cls, value: Any) -> Any:
        """Content parts of type text are joined; an assistant message may have null content."""
        if not isinstance(value, dict):
            return value
        content = value.get("content")
        if content is None and value.get("role") == "assistant":
            return {**value, "content": ""}
        if isinstance(content, list):
            texts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise ValueError("only string content or content parts of type 'text' are supported")
                texts.append(part["text"])
            return {**value, "content": "".join(texts)}
        return value


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def chat_messages(self) -> list[dict[str, str]]:
        """Messages for the chat template ('developer' is the newer name of 'system')."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.content}
            for m in self.messages
        ]


RequestT = TypeVar("RequestT", bound=SamplingRequest)


# -- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, seq: Sequence) -> Usage:
        prompt, completion = len(seq.prompt_ids), len(seq.output_ids)
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=seq.cached_tokens),
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative: dict[str, float | int]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative: dict[str, float | int]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def parse_request(raw: bytes, schema: type[RequestT]) -> RequestT:
    """Decode, parse and validate a request body; every failure is a 400 naming the problem."""
    body = json_object(raw)
    check_unsupported(body)
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc.errors()) from None
