"""A conversation's input items (Responses API) and the chat messages they become.

Messages (``role`` user, system, developer or assistant; ``content`` a string or ``input_text`` /
``output_text`` parts; ``"type": "message"`` optional), ``function_call`` items (an assistant's tool calls:
consecutive calls, and calls after an assistant message, form one assistant message with ``tool_calls``),
``function_call_output`` items (``role: "tool"`` messages). ``reasoning`` items are accepted and dropped:
this server's models write none, and a conversation replayed from another model's may carry them. Any
other item type is refused, naming it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Discriminator, Field, Tag, TypeAdapter, field_validator

from specserve.server import chat_request as c
from specserve.server.strict import StrictModel

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _text_parts(value: Any) -> Any:
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text"):
                raise ValueError(
                    f"content parts of type {kind!r} are not supported; only input_text and output_text"
                )
    return value


class TextPart(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str


Content = Annotated[str | list[TextPart], BeforeValidator(_text_parts)]


def text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


class FunctionCallItem(StrictModel):
    """A call the model made (an earlier response's output item, sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(pattern=c.CALL_ID)
    name: str = Field(pattern=c.FUNCTION_NAME)
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_arguments(cls, value: str) -> str:
        if value.strip():
            try:
                json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"the arguments are not JSON: {value[:80]!r}") from None
        return value


class FunctionCallOutputItem(StrictModel):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(pattern=c.CALL_ID)
    output: Content


class ReasoningItem(StrictModel):
    """Accepted and dropped (see the module docstring)."""

    type: Literal["reasoning"]


def tagged(tags: dict[str, str], default: str | None = None) -> Discriminator:
    """A union discriminated by ``type``; the tags are capitalized so that error params skip them."""

    def tag(value: Any) -> str | None:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        if kind is None:
            kind = default
        return tags.get(kind) if isinstance(kind, str) else None

    return Discriminator(tag)


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")]
    | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")]
    | Annotated[ReasoningItem, Tag("Reasoning")],
    tagged(
        {
            "message": "Message",
            "function_call": "FunctionCall",
            "function_call_output": "FunctionCallOutput",
            "reasoning": "Reasoning",
        },
        default="message",
    ),
]
HISTORY: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


def known_items(value: Any) -> Any:
    """``input``'s items checked for a known type first: an unknown one is named in the error (a union's own
    message would only list its members)."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise ValueError(f"input[{i}] must be an object (an input item)")
            kind = item.get("type")
            if kind is not None and kind not in ITEM_TYPES:
                raise ValueError(
                    f"input[{i}] has type {kind!r}, which this server does not support; the item types "
                    "are message, function_call, function_call_output and reasoning (ignored)"
                )
    return value


def history_items(conversation: list[dict[str, Any]]) -> list[InputItem]:
    """A stored conversation's items (validated when they were stored, read again here)."""
    return HISTORY.validate_python(conversation)


def stored_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """Items as the store keeps them (reasoning items dropped)."""
    return [
        item.model_dump(mode="json", by_alias=True) for item in items if not isinstance(item, ReasoningItem)
    ]


def chat_messages(instructions: str | None, items: list[InputItem]) -> list[dict[str, Any]]:
    """Chat messages of the items, after a system message of the instructions."""
    messages: list[dict[str, Any]] = (
        [] if instructions is None else [{"role": "system", "content": instructions}]
    )
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
    return messages
