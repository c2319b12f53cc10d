"""OpenAI request schemas for ``/v1/completions`` and the fields every generation request shares (chat's own
are in chat_request.py; response bodies in responses.py).

Requests are validated strictly (no string-to-number coercion, no NaN; ``null`` means the default) once,
here. Supported fields:

* ``model``: optional; the served model id (or the ``--target`` value), anything else is a 404;
* ``prompt``: a string, token ids, or a list of up to ``MAX_PROMPTS`` of either (a batch: choice
  ``i * n + j`` is prompt ``i``'s ``j``-th); ``echo`` (with ``logprobs``: the prompt's tokens with their
  logprobs, the first ``null``); ``suffix`` (fill-in-the-middle, where the model has FIM tokens);
  ``logprobs: N``;
* ``max_tokens`` (chat: also ``max_completion_tokens``): default is the room left in the context;
  prompt + max_tokens beyond the context is a 400 naming both numbers; completions take 0 (the prompt
  only: with ``echo``, its text and logprobs);
* vLLM's ``prompt_logprobs: N``: each prompt token's logprob, rank and ``N`` alternatives (both endpoints);
* ``temperature`` (0..2, default 1; 0 is greedy), ``top_p``, ``top_k`` (0 or -1 disables), ``min_p``,
  ``seed``, ``stop`` (a string or up to ``MAX_STOP_STRINGS`` strings of at most ``MAX_STOP_LENGTH``
  characters: more than OpenAI's 4), ``stop_token_ids``, ``stream``, ``stream_options.include_usage``,
  ``n`` (up to ``MAX_CHOICES``), ``user``;
* penalties, applied to the target's distribution inside verification: ``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty`` (vLLM's), ``logit_bias``;
* structured outputs: ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``
  (structured_request.py);
* extensions: ``ignore_eos`` and ``speculative: {enabled, drafter, num_draft_tokens}``, which overrides the
  server's speculation default for the request (an unknown drafter is a 400).

Known fields that would change the answer and are not implemented (``best_of`` > 1, beam search, the
deprecated ``functions``) are accepted only at their neutral value; any other unknown field is ignored, as
vLLM ignores it.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import (
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from specserve.request import MAX_LOGPROBS, GrammarSpec, SamplingParams
from specserve.sequence import SpeculationOptions
from specserve.server.errors import from_validation, invalid_request
from specserve.server.request_body import json_object
from specserve.server.strict import StrictModel, integral
from specserve.server.structured_request import ResponseFormat, StructuredOutputs, grammar_spec

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_CHOICES = 16
MAX_PROMPTS = 64
"""Prompts in one completions request (lm-eval batches its loglikelihood requests)."""
MAX_LOGIT_BIAS = 1024

# Known OpenAI (and vLLM) fields without an implementation here, with the values that mean "not used".
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "functions": (None, []),
    "function_call": (None, "none"),
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
        {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
            "maxItems": MAX_PROMPTS,
        },
        _TOKEN_IDS,
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
    ]
}


class SpeculativeRequest(StrictModel):
    """Extension: per-request speculation (unset fields keep the server default)."""

    enabled: bool | None = None
    drafter: str | None = Field(None, min_length=1, max_length=64)
    num_draft_tokens: int | None = Field(None, ge=0, le=64)

    def options(self) -> SpeculationOptions:
        return SpeculationOptions(self.enabled, self.drafter, self.num_draft_tokens)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingRequest(StrictModel):
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
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0)
    """vLLM's; below 0.01 a float32 logit divided by it overflows (the limit keeps logits finite)."""
    logit_bias: dict[str, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    """Token id (as a string, OpenAI's form) → bias in [-100, 100] added to its logit."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    user: str | None = None
    ignore_eos: bool = False
    speculative: SpeculativeRequest | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    """vLLM's field: requests reuse each other's cached prompt KV only if their salts are equal."""
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each prompt token's logprob and rank, and this many alternatives at its position."""

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

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float]) -> dict[str, float]:
        for key, bias in value.items():
            if not key.isdigit() or key != str(int(key)):  # "05" would be a second entry for token 5
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    def grammar(self) -> GrammarSpec | None:
        """The structured-output constraint the request asks for (400 if several or malformed)."""
        legacy = StructuredOutputs.model_construct(
            json_=self.guided_json,
            regex=self.guided_regex,
            choice=self.guided_choice,
            grammar=self.guided_grammar,
        )  # the same constraints under vLLM's older names, already validated as this request's fields
        try:
            return grammar_spec(self.response_format, self.structured_outputs, legacy)
        except ValueError as exc:
            raise invalid_request(str(exc), "response_format") from None

    def num_logprobs(self) -> int | None:
        """Alternatives per token to return with logprobs; None: no logprobs."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token the engine must compute; None: no prompt logprobs."""
        return self.prompt_logprobs

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
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=tuple((int(t), float(b)) for t, b in self.logit_bias.items()),
                stop_token_ids=tuple(self.stop_token_ids),
                logprobs=self.num_logprobs(),
                grammar=self.grammar(),
                prompt_logprobs=self.num_prompt_logprobs(),
            )
        except ValueError as exc:
            raise invalid_request(str(exc)) from None


class CompletionRequest(SamplingRequest):
    prompt: Annotated[list[str | list[int]], WithJsonSchema(PROMPT_SCHEMA)]
    """The prompts, each a string or token ids (one prompt as given is a list of one)."""
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """The legacy API's form: the number of alternatives per token (0: the chosen token's only)."""
    echo: bool = False
    """Return the prompt text before the completion (with ``logprobs``: its tokens' logprobs too)."""
    suffix: str | None = None
    """Text after the insertion point: fill-in-the-middle, where the model has FIM tokens."""

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        echoed = self.logprobs if self.echo else None
        wanted = [n for n in (echoed, self.prompt_logprobs) if n is not None]
        return max(wanted) if wanted else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        if isinstance(value, str) or (
            isinstance(value, list) and value and not isinstance(value[0], str | list)
        ):
            value = [value]  # one prompt: a string or token ids
        if not isinstance(value, list) or not value:
            raise ValueError("must be a string, token ids, or a non-empty list of either")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(value)}")
        prompts: list[str | list[int]] = []
        for prompt in value:
            if isinstance(prompt, list) and not prompt:
                raise ValueError("a prompt must not be empty")
            if not isinstance(prompt, str | list):
                raise ValueError("must be a string, token ids, or a non-empty list of either")
            prompts.append([integral(v) for v in prompt] if isinstance(prompt, list) else prompt)
        return prompts

    @model_validator(mode="after")
    def _choices(self) -> CompletionRequest:
        if len(self.prompt) * self.n > MAX_PROMPTS:
            raise ValueError(f"prompts × n must be at most {MAX_PROMPTS}, got {len(self.prompt) * self.n}")
        return self


RequestT = TypeVar("RequestT", bound=SamplingRequest)


def parse_request(raw: bytes, schema: type[RequestT]) -> RequestT:
    """Decode, parse and validate a request body; every failure is a 400 naming the problem."""
    body = json_object(raw)
    check_unsupported(body)
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc.errors()) from None
