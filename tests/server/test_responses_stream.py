"""Streamed Responses events without a server: their order and numbering, text then a tool call streamed
piece by piece under a forced tool grammar, and the same output items as the non-streamed body."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any, cast

from openai.types.responses import Response

from specserve.engine.output_processor import RequestOutput, RequestState
from specserve.sequence import SpecStats
from specserve.server.responses_api import parse_responses_request
from specserve.server.responses_output import ResponseFrame, complete
from specserve.server.responses_stream import response_events
from specserve.server.streaming import Choice
from specserve.server.tool_stream import ToolParsing

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc", "n": [1, 2]}}\n</tool_call>'


def fake_seq(finish_reason: str) -> RequestState:
    seq = SimpleNamespace(
        finish_reason=finish_reason,
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        cached_tokens=1,
        stats=SpecStats(),
    )
    return cast(RequestState, seq)


def frame() -> ResponseFrame:
    request = parse_responses_request(json.dumps({"input": "x", "metadata": {"m": "é"}}).encode())
    return ResponseFrame("resp_1", 1, "tiny", request)


async def run(
    pieces: list[str], reason: str, tools: ToolParsing | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    seq = fake_seq(reason)
    outputs = [RequestOutput(seq, [], piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]

    async def rest() -> AsyncGenerator[RequestOutput, None]:
        for out in outputs[1:]:
            yield out

    async def first() -> RequestOutput:
        await asyncio.sleep(0.05)  # long enough for keep-alive comments
        return outputs[0]

    stored: list[dict[str, Any]] = []
    choice = Choice(0, "resp_1", asyncio.create_task(first()), rest())
    raw = b"".join([chunk async for chunk in response_events(choice, frame(), tools, 0.01, stored.append)])
    assert raw.count(b": waiting\n\n") >= 2
    events = []
    for block in raw.decode().split("\n\n"):
        lines = block.splitlines()
        if lines and lines[0].startswith("event: "):
            data = json.loads(lines[1].removeprefix("data: "))
            assert lines[0] == f"event: {data['type']}"
            events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, stored


def test_text_then_a_call_stream_as_items_in_order() -> None:
    tools = ToolParsing(frozenset({"get_time"}))
    pieces = ["Let me ", "check.", "\n" + CALL[:30], CALL[30:60], CALL[60:]]
    events, stored = asyncio.run(run(pieces, "stop", tools))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    done_text = kinds.index("response.output_text.done")
    assert set(kinds[4:done_text]) == {"response.output_text.delta"}
    assert kinds[done_text:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]  # fmt: skip  (the Hermes parser gives a call whole, as one piece)
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["content"] == []  # the part comes in response.content_part.added
    final = events[-1]["response"]
    Response.model_validate(final)
    assert stored == [final] and final["status"] == "completed" and final["metadata"] == {"m": "é"}
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"zone": "utc", "n": [1, 2]}'
    assert (
        final["usage"]["input_tokens"] == 3 and final["usage"]["input_tokens_details"]["cached_tokens"] == 1
    )
    whole = complete(frame(), "".join(pieces), fake_seq("stop"), tools)
    assert strip_ids(whole["output"]) == strip_ids(final["output"])


def strip_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_a_forced_call_streams_its_arguments_in_pieces_and_can_be_cut_off() -> None:
    tools = ToolParsing(frozenset({"get_time"}), forced=True)
    text = '{"name": "get_time", "arguments": {"zone": "utc"}}'
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    events, _ = asyncio.run(run(pieces, "stop", tools))
    added = next(e for e in events if e["type"] == "response.output_item.added")
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert (
        len(deltas) > 2
        and "".join(deltas) == '{"zone": "utc"}' == events[-1]["response"]["output"][0]["arguments"]
    )
    cut, _ = asyncio.run(run(pieces[:5], "length", tools))
    final = cut[-1]["response"]
    assert cut[-1]["type"] == "response.incomplete" and final["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert final["output"][0]["status"] == "incomplete"
    assert strip_ids(final["output"]) == strip_ids(
        complete(frame(), "".join(pieces[:5]), fake_seq("length"), tools)["output"]
    )


def test_nothing_generated_is_an_empty_message_and_an_error_finish_is_failed() -> None:
    events, _ = asyncio.run(run([""], "stop", None))
    assert [i["content"][0]["text"] for i in events[-1]["response"]["output"]] == [""]
    failed, _ = asyncio.run(run(["abc"], "error", None))
    assert (
        failed[-1]["type"] == "response.failed" and failed[-1]["response"]["error"]["code"] == "server_error"
    )
