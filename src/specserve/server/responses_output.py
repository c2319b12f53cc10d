"""The Responses API's response object: its schema (for the OpenAPI document; every body sent is validated
by it) and how a finished generation becomes it.

``status`` is ``completed`` when the model stopped, ``incomplete`` (``incomplete_details.reason:
"max_output_tokens"``) when it ran out of tokens (``max_output_tokens`` or the context), ``failed`` with an
``error`` otherwise. ``output`` holds a ``message`` item with one ``output_text`` part when there is text
(or nothing at all: an empty message) and a ``function_call`` item per tool call; the last item of an
incomplete response is ``incomplete``. The request's settings are echoed, as OpenAI echoes them;
``speculative`` (this server's extension, as in chat) holds the speculation statistics.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from specserve.engine.output_processor import RequestState
from specserve.server.responses_api import ResponsesRequest
from specserve.server.tool_stream import ToolParsing

ItemStatus = Literal["in_progress", "completed", "incomplete"]
Status = Literal["in_progress", "completed", "incomplete", "failed"]


def new_id(prefix: str) -> str:
    """``resp_…``, ``msg_…``, ``fc_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    """JSON text (incomplete when the response ran out of tokens inside the call)."""
    status: ItemStatus


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""
    cache_write_tokens: int = 0
    """Not measured here (OpenAI's newer field; its clients require it)."""


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, request: RequestState) -> ResponseUsage:
        prompt, output = len(request.prompt_ids), len(request.output_ids)
        return cls(
            input_tokens=prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=request.cached_tokens),
            output_tokens=output,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=prompt + output,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """OpenAI's ``response`` object, as this server fills it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float
    top_p: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    metadata: dict[str, str]
    user: str | None
    store: bool
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | None = None
    speculative: dict[str, Any] | None = None
    """This server's extension: the speculation statistics of the generation."""


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool


@dataclass(frozen=True)
class ResponseFrame:
    """What every snapshot of one response shares: its id, creation time, model and request."""

    id: str
    created_at: int
    model: str
    request: ResponsesRequest

    def body(
        self,
        status: Status,
        output: list[dict[str, Any]],
        request: RequestState | None = None,
        error: ResponseError | None = None,
    ) -> dict[str, Any]:
        """The response object as JSON-ready data (validated against :class:`ResponseObject`)."""
        req = self.request
        response = ResponseObject.model_validate(
            {
                "id": self.id,
                "created_at": self.created_at,
                "status": status,
                "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens,
                "model": self.model,
                "output": output,
                "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id,
                "temperature": req.temperature,
                "top_p": req.top_p,
                "tool_choice": req.echoed_tool_choice(),
                "tools": req.echoed_tools(),
                "text": req.echoed_text(),
                "metadata": req.metadata,
                "user": req.user,
                "store": req.store,
                "usage": None if request is None else ResponseUsage.of(request),
                "speculative": None if request is None else request.stats.as_dict(),
            }
        )
        return response.model_dump(mode="json")


def status_of(request: RequestState) -> tuple[Status, ResponseError | None]:
    """A finished generation's status (and error, when it failed)."""
    if request.finish_reason == "stop":
        return "completed", None
    if request.finish_reason == "length":
        return "incomplete", None
    message = f"The generation ended without finishing ({request.finish_reason})."
    return "failed", ResponseError(code="server_error", message=message)


def item_status(status: Status, last: bool) -> ItemStatus:
    return "completed" if status == "completed" or not last else "incomplete"


def message_item(item_id: str, text: str, status: ItemStatus) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: ItemStatus) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def complete(
    frame: ResponseFrame, text: str, request: RequestState, tools: ToolParsing | None
) -> dict[str, Any]:
    """The body of a finished, non-streamed response: the text, and the tool calls parsed from it."""
    content, calls = tools.parse(text) if tools is not None else (text, [])
    status, error = status_of(request)
    texts = [content] if content or not calls else []
    count = len(texts) + len(calls)
    output = [message_item(new_id("msg"), t, item_status(status, count == 1)) for t in texts]
    for i, call in enumerate(calls, len(texts)):
        function = call["function"]
        state = item_status(status, i == count - 1)
        output.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"], state))
    return frame.body(status, output, request, error)


def conversation_output(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output items as the next turn's input: a call cut off (not complete JSON) is left out."""
    return [
        item
        for item in body["output"]
        if not (item["type"] == "function_call" and item["status"] != "completed")
    ]
