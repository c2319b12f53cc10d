"""The chat completions request: messages (tool calls and tool results included), the tools offered and
``tool_choice``, chat's logprobs fields. Shared fields and their validation are in protocol.py.

Tools are rendered by the model's own chat template. ``tool_choice`` ``required`` or a named function
becomes a grammar (server/tool_grammar.py) that forces Hermes-style tool calls; with ``auto`` the model
chooses, under a lazy grammar that applies once it starts a call, and its calls are parsed from the
output. Function names follow OpenAI's rule, which also keeps
template text out of them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from specserve.request import MAX_LOGPROBS, GrammarSpec
from specserve.server.errors import invalid_request
from specserve.server.protocol import SamplingRequest
from specserve.server.strict import StrictModel
from specserve.server.tool_grammar import auto_tool_grammar, tool_choice_grammar
from specserve.server.tool_stream import ToolParsing

FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
"""OpenAI's rule for function names; it also keeps template text out of the names the template writes raw."""


CALL_ID = r"^[A-Za-z0-9_.:\-]{1,256}$"
"""Tool call ids as clients send them (``call_…``, Mistral's 9 characters): templates may print them raw."""


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(StrictModel):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(StrictModel):
    """An assistant message's earlier tool call, as the client sends it back in the history."""

    id: str | None = Field(None, pattern=CALL_ID)
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """Arguments as an object: templates write ``arguments | tojson`` (a string would be quoted)."""
        arguments: Any = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise ValueError(f"tool call arguments are not JSON: {arguments[:80]!r}") from None
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, pattern=CALL_ID)

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
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("top_logprobs needs logprobs: true", "top_logprobs")
        return self.top_logprobs if self.logprobs else None

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages for the chat template ('developer' is the newer name of 'system')."""
        messages: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            message: dict[str, Any] = {
                "role": "system" if m.role == "developer" else m.role,
                "content": m.content,
            }
            if m.tool_calls:
                try:
                    message["tool_calls"] = [c.for_template() for c in m.tool_calls]
                except ValueError as exc:
                    raise invalid_request(str(exc), f"messages[{i}].tool_calls") from None
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        return messages

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (none when ``tool_choice`` is ``none``)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_parsing(self, grammar: GrammarSpec | None) -> ToolParsing | None:
        """How tool calls are read from the output; None when the request offers no tools. ``grammar`` is
        the request's (``grammar()``, already built): under a tool grammar calls stream piece by piece."""
        tools = self.template_tools()
        if tools is None:
            return None
        names = frozenset(t["function"]["name"] for t in tools)
        if grammar is None or super().grammar() is not None:  # no grammar, or the response format's
            return ToolParsing(names)
        return ToolParsing(names, grammar.triggers, forced=not grammar.triggers)

    def grammar(self) -> GrammarSpec | None:
        """``tool_choice`` ``required`` or a named function is a grammar too (one constraint per request)."""
        spec = super().grammar()
        tool_choice = self.tool_choice
        choice = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else tool_choice
        if choice == "none" or (choice in (None, "auto") and not self.tools):
            return spec
        if choice in (None, "auto"):  # free text, or calls of offered tools once the model starts one
            try:
                lazy = auto_tool_grammar(self.template_tools() or [], self.parallel_tool_calls is not False)
            except ValueError as exc:
                raise invalid_request(str(exc), "tools") from None
            return spec if spec is not None else lazy  # a response_format constrains the text instead
        if not self.tools:
            raise invalid_request("tool_choice needs tools", "tool_choice")
        if spec is not None:
            raise invalid_request(
                "tool_choice 'required' or a named tool cannot be combined with response_format"
            )
        tools = self.template_tools() or []
        try:
            grammar = tool_choice_grammar(tools, str(choice), self.parallel_tool_calls is not False)
            return GrammarSpec("grammar", grammar)
        except ValueError as exc:
            raise invalid_request(str(exc), "tool_choice") from None
