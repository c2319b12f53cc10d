"""The Responses API's request (``POST /v1/responses``) and the chat completions request it runs as.

A Responses request is a conversation of input items (server/responses_items.py) plus settings; it becomes
a :class:`ResponsesChatRequest` (a ``ChatCompletionRequest``) so that the chat path serves it: the same
prompt rendering, tools, grammars, limits and errors. Accepted:

* ``input``: a string (one user message) or a list of items (any other item type than those of
  responses_items.py is a 400 naming it, ``param: "input"``);
* ``instructions`` (a system message first; not carried over by ``previous_response_id``, as OpenAI's);
  function ``tools`` (other tool types are a 400, ``param: "tools"``), ``tool_choice``,
  ``parallel_tool_calls``; ``text.format`` ``text`` / ``json_object`` / ``json_schema`` (the chat
  ``response_format``); ``max_output_tokens``, ``temperature``, ``top_p``, ``seed``; ``metadata``,
  ``user``, ``stream``, ``store``, ``previous_response_id``, ``model``; this server's ``speculative`` and
  ``cache_salt`` as in chat.

Not implemented and refused unless null or false: ``background``, ``conversation``, ``prompt`` (stored
prompt templates). Other unknown fields (``include``, ``reasoning``, ``truncation``, ...) are ignored, as
vLLM ignores them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Tag, ValidationError, field_validator

from specserve.server import chat_request as c
from specserve.server.errors import from_validation, invalid_request
from specserve.server.protocol import SpeculativeRequest
from specserve.server.request_body import json_object
from specserve.server.responses_items import InputItem, MessageItem, chat_messages, known_items, tagged
from specserve.server.strict import StrictModel

UNSUPPORTED = ("background", "conversation", "prompt")
"""Known Responses fields without an implementation here: a 400 unless null or false."""


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=c.FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=c.FUNCTION_NAME)


class PlainTextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectTextFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaTextFormat(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[
    Annotated[PlainTextFormat, Tag("Text")]
    | Annotated[JsonObjectTextFormat, Tag("JsonObject")]
    | Annotated[JsonSchemaTextFormat, Tag("JsonSchema")],
    tagged({"text": "Text", "json_object": "JsonObject", "json_schema": "JsonSchema"}),
]


class TextConfig(StrictModel):
    format: TextFormat = Field(default_factory=lambda: PlainTextFormat(type="text"))

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's ``response_format``."""
        fmt = self.format
        if isinstance(fmt, JsonSchemaTextFormat):
            schema = {
                "name": fmt.name,
                "schema": fmt.schema_,
                "description": fmt.description,
                "strict": fmt.strict,
            }
            return {"type": "json_schema", "json_schema": schema}
        return {"type": "json_object"} if isinstance(fmt, JsonObjectTextFormat) else None


MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(StrictModel):
    model: str | None = Field(None, max_length=512)
    input: list[InputItem] | str = Field(default_factory=list)
    instructions: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    text: TextConfig = Field(default_factory=TextConfig)
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=16)
    user: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    speculative: SpeculativeRequest | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        return known_items(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise ValueError(
                        f"tools[{i}] has type {kind!r}; this server supports function tools only "
                        "(no built-in tools such as web_search, file_search or mcp)"
                    )
        return value

    def items(self) -> list[InputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def echoed_tools(self) -> list[dict[str, Any]]:
        return [tool.model_dump(mode="json") for tool in self.tools]

    def echoed_tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        return choice if isinstance(choice, str) else choice.model_dump(mode="json")

    def echoed_text(self) -> dict[str, Any]:
        return {"format": self.text.format.model_dump(mode="json", by_alias=True, exclude_none=True)}


def parse_responses_request(raw: bytes) -> ResponsesRequest:
    """Decode and validate a body; every failure is a 400 naming the field."""
    body = json_object(raw)
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise invalid_request(f"'{name}' is not supported by this server; omit it.", name, "unsupported")
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation(exc.errors()) from None


class ResponsesChatRequest(c.ChatCompletionRequest):
    """The chat request a Responses request runs as (errors that name its length say max_output_tokens)."""

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_completion_tokens, "max_output_tokens"


def chat_request(request: ResponsesRequest, items: list[InputItem]) -> ResponsesChatRequest:
    """The chat completions request of ``request`` over ``items`` (any earlier conversation, then its own)."""
    messages = chat_messages(request.instructions, items)
    if not messages:
        raise invalid_request("The input is empty: give input items or instructions.", "input")
    tools = [
        {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
        for tool in request.tools
    ]
    choice = request.tool_choice
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "tools": tools or None,
        "tool_choice": choice
        if isinstance(choice, str)
        else {"type": "function", "function": {"name": choice.name}},
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": request.text.response_format(),
        "user": request.user,
        "stream": request.stream,
        "speculative": request.speculative,
        "cache_salt": request.cache_salt,
    }
    try:
        return ResponsesChatRequest.model_validate(body)
    except ValidationError as exc:  # the items were validated already; a message names what is left
        error = from_validation(exc.errors())
        raise invalid_request(error.message, "input") from None
