"""A streamed response of the Responses API: the server-sent events of one generation.

Each event is ``event: <type>`` and ``data: <json>``, the JSON carrying ``type`` and ``sequence_number``
(0, 1, 2, ...). In order: ``response.created`` and ``response.in_progress`` (status ``in_progress``, no
output) at once; for text ``response.output_item.added`` (a ``message``), ``response.content_part.added``
(an empty ``output_text``), ``response.output_text.delta`` per piece, then ``response.output_text.done``,
``response.content_part.done`` and ``response.output_item.done``; for each tool call
``response.output_item.added`` (a ``function_call`` with empty ``arguments``),
``response.function_call_arguments.delta`` per piece of the arguments as they are generated (the chat
stream's pieces, server/tool_stream.py), ``response.function_call_arguments.done`` and
``response.output_item.done``; finally ``response.completed``, ``response.incomplete`` or
``response.failed`` with the whole response, as the non-streamed body would be. There is no ``[DONE]``.

Until the first token an SSE comment every ``keepalive`` seconds keeps the connection busy. An error after
the stream started (a timeout, a stopped engine) is an ``error`` event, then ``response.failed``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from typing import Any

from specserve.engine.output_processor import RequestState
from specserve.server.errors import APIError
from specserve.server.responses_output import (
    ResponseError,
    ResponseFrame,
    Status,
    call_item,
    item_status,
    message_item,
    new_id,
    status_of,
)
from specserve.server.streaming import KEEPALIVE, Choice, stream_failure
from specserve.server.tool_stream import ToolParsing

TERMINAL = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


class ResponseEvents:
    """The numbered events of one response, and the output items they have built."""

    def __init__(self, frame: ResponseFrame) -> None:
        self.frame = frame
        self.number = 0
        self.output: list[dict[str, Any]] = []
        """Items done."""
        self._item: dict[str, Any] | None = None
        """The item being written (text or arguments accumulate in it)."""

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        # ASCII: the echoed request (tool parameters, schemas) may hold lone surrogates
        data = json.dumps(payload, ensure_ascii=True, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def start(self) -> list[bytes]:
        response = self.frame.body("in_progress", [])
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def _where(self) -> dict[str, Any]:
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": len(self.output)}

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        """Announce an item; a message's text part follows in its own event (the item shows no content)."""
        self._item = item
        shown = {**item, "content": []} if item["type"] == "message" else item
        events = [self.event("response.output_item.added", output_index=len(self.output), item=shown)]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        return events

    def text(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        events = [] if self._item is not None and self._item["type"] == "message" else self.close()
        if self._item is None:
            events += self._open(message_item(new_id("msg"), "", "in_progress"))
        assert self._item is not None
        self._item["content"][0]["text"] += delta
        events.append(
            self.event(
                "response.output_text.delta", **self._where(), content_index=0, delta=delta, logprobs=[]
            )
        )
        return events

    def calls(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """Chat ``tool_calls`` deltas: a head (with ``id``) opens a call, pieces extend its arguments."""
        events: list[bytes] = []
        for delta in deltas:
            function = delta.get("function", {})
            if "id" in delta:
                events += self.close()
                events += self._open(
                    call_item(new_id("fc"), delta["id"], function["name"], "", "in_progress")
                )
            piece = function.get("arguments") or ""
            if piece and self._item is not None and self._item["type"] == "function_call":
                self._item["arguments"] += piece
                events.append(
                    self.event("response.function_call_arguments.delta", **self._where(), delta=piece)
                )
        return events

    def close(self, status: Status = "completed") -> list[bytes]:
        """Finish the open item (``incomplete`` unless the response completed)."""
        item = self._item
        if item is None:
            return []
        item["status"] = item_status(status, last=True)
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self.event(
                    "response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]
                ),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            events = [
                self.event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            ]
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        self._item = None
        return events

    def finish(self, request: RequestState) -> tuple[list[bytes], dict[str, Any]]:
        """The last events and the response, when the generation ended."""
        status, error = status_of(request)
        events = (
            self._open(message_item(new_id("msg"), "", "in_progress"))
            if not self.output and self._item is None
            else []
        )
        events += self.close(status)
        body = self.frame.body(status, self.output, request, error)
        return [*events, self.event(TERMINAL[status], response=body)], body

    def fail(self, error: APIError) -> tuple[list[bytes], dict[str, Any]]:
        events = self.close("failed")
        events.append(self.event("error", code=error.code, message=error.message, param=error.param))
        body = self.frame.body(
            "failed", self.output, error=ResponseError(code="server_error", message=error.message)
        )
        return [*events, self.event("response.failed", response=body)], body


async def response_events(
    choice: Choice,
    frame: ResponseFrame,
    tools: ToolParsing | None,
    keepalive: float,
    done: Callable[[dict[str, Any]], None],
) -> AsyncGenerator[bytes, None]:
    """The SSE body of a response's one choice (already admitted); ``done`` gets the final response before
    its last event is sent (so a client that reads it can retrieve the response at once)."""
    events = ResponseEvents(frame)
    parser = tools.streaming() if tools is not None else None
    for event in events.start():
        yield event
    try:
        while not (await asyncio.wait({choice.first}, timeout=keepalive))[0]:
            yield KEEPALIVE  # waiting for a slot, then for the prompt's prefill
        out = choice.first.result()
        while True:
            text, calls = out.text_delta, list[dict[str, Any]]()
            if parser is not None:
                text, calls = parser.feed(text)
                if out.finished:
                    rest, more = parser.finish()
                    text, calls = text + rest, calls + more
            for event in [*events.text(text), *events.calls(calls)]:
                yield event
            if out.finished:
                break
            out = await anext(choice.outputs)
        last, body = events.finish(out.state)
    except Exception as exc:
        last, body = events.fail(stream_failure(exc, frame.id))
    done(body)
    for event in last:
        yield event
