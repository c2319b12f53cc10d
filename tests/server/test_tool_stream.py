"""Tool calls under a tool grammar, streamed as OpenAI streams them: the head, then the arguments in pieces;
the same content and calls in any split of the output (one character, one token or sixteen per delta)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from specserve.server.tool_grammar import auto_tool_grammar
from specserve.server.tool_stream import ToolParsing, assemble, one_entry_per_call

NAMES = frozenset({"get_weather", "get_time"})
TOOLS = [{"type": "function", "function": {"name": name}} for name in sorted(NAMES)]
SPEC = auto_tool_grammar(TOOLS)
assert SPEC is not None
AUTO = ToolParsing(NAMES, SPEC.triggers)
REQUIRED = ToolParsing(NAMES, forced=True)
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a, \\"b\\": c"}}'
TIME = '{"name": "get_time", "arguments": {}}'
ARGS = {"city": "Paris", "days": [1, 2], "note": 'a, "b": c'}

OUTPUTS = [  # (output, parsing, content, [(name, arguments)])
    (f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>", AUTO, "Let me look.", [("get_weather", ARGS)]),
    (
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
        AUTO,
        "",
        [("get_weather", ARGS), ("get_time", {})],
    ),
    (
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
        AUTO,
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    ("{" + WEATHER + "}", AUTO, "", [("get_weather", ARGS)]),
    (f"[{WEATHER},{TIME}]", AUTO, "", [("get_weather", ARGS), ("get_time", {})]),
    ('{"name": "Alice", "age": 3}', AUTO, '{"name": "Alice", "age": 3}', []),  # JSON, not a call
    ("Plain text, with a < and a <tool in it.", AUTO, "Plain text, with a < and a <tool in it.", []),
    (
        f"<tool_call>\n{TIME}\n</tool_call>\n<tool_call>\n{WEATHER}\n</tool_call>",
        REQUIRED,
        "",
        [("get_time", {}), ("get_weather", ARGS)],
    ),
]


def _splits(text: str, rng: random.Random) -> list[list[str]]:
    """The whole text, one character per delta, and random pieces of 1 to 16 characters."""
    pieces = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return pieces


def _stream(parsing: ToolParsing, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    stream = parsing.streaming()
    content, deltas = "", list[dict[str, Any]]()
    for piece in pieces:
        text, more = stream.feed(piece)
        content, deltas = content + text, deltas + more
    text, more = stream.finish()
    return content + text, deltas + more


@pytest.mark.parametrize(("output", "parsing", "content", "calls"), OUTPUTS)
def test_any_split_gives_the_same_content_and_calls(
    output: str, parsing: ToolParsing, content: str, calls: list[tuple[str, Any]]
) -> None:
    whole_content, whole_calls = parsing.parse(output)
    assert whole_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole_calls] == calls
    for call in whole_calls:  # the arguments as json.dumps writes them, whatever the model's whitespace
        assert call["function"]["arguments"] == json.dumps(json.loads(call["function"]["arguments"]))
    for pieces in _splits(output, random.Random(len(output))):
        streamed_content, deltas = _stream(parsing, pieces)
        assert streamed_content == content, pieces
        assembled = assemble(deltas)
        assert [c["function"] for c in assembled] == [c["function"] for c in whole_calls], pieces


def test_a_call_streams_head_first_then_its_arguments_in_pieces() -> None:
    stream = AUTO.streaming()
    deltas: list[dict[str, Any]] = []
    text = f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    for char in text:
        deltas += stream.feed(char)[1]
    heads = [d for d in deltas if "id" in d]
    assert [h["index"] for h in heads] == [0, 1]
    assert all(h["type"] == "function" and h["function"]["arguments"] == "" for h in heads)
    assert [h["function"]["name"] for h in heads] == ["get_weather", "get_time"]
    first = [d for d in deltas if d["index"] == 0 and "id" not in d]
    assert len(first) > 5 and deltas.index(heads[1]) > deltas.index(first[-1])  # one call, then the next


def test_one_delta_that_ends_a_call_and_starts_the_next() -> None:
    text = f"[{WEATHER}, {TIME}]"
    cut = text.index(TIME) + len('{"name": "get_time", "arguments": ')  # one call's end, the next's head
    stream = AUTO.streaming()
    _, early = stream.feed(text[: text.index("Paris")])
    _, middle = stream.feed(text[text.index("Paris") : cut])
    _, late = stream.feed(text[cut:])
    assert {d["index"] for d in middle} == {0, 1}
    assert [c["function"]["name"] for c in assemble(early + middle + late)] == ["get_weather", "get_time"]


def test_text_before_a_call_streams_and_a_partial_tag_is_held() -> None:
    stream = AUTO.streaming()
    assert stream.feed("I will check the weather. <tool") == ("I will check the weather.", [])
    content, deltas = stream.feed("_call>\n{")
    assert content == "" and deltas == []
    assert stream.feed('"name": "get_time", "arguments": ')[1][0]["function"]["name"] == "get_time"


def test_a_call_cut_off_by_max_tokens_is_returned_as_far_as_it_got() -> None:
    content, calls = AUTO.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


def test_a_head_and_the_arguments_of_its_step_are_one_entry_per_call() -> None:
    head: dict[str, Any] = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    pieces = [
        {"index": 0, "function": {"arguments": '{"a": '}},
        {"index": 0, "function": {"arguments": "1}"}},
    ]
    nxt = {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g", "arguments": ""}}
    merged = one_entry_per_call([head, *pieces, nxt, {"index": 1, "function": {"arguments": "{}"}}])
    assert [m["index"] for m in merged] == [0, 1]
    assert merged[0] == {**head, "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert merged[1]["id"] == "call_2" and merged[1]["function"]["arguments"] == "{}"
    assert head["function"]["arguments"] == ""  # the inputs are not changed
