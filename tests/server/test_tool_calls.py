"""Hermes tool-call parsing (whole and streamed) and the tool_choice grammar, without a server.

The streaming parser is checked against an independent regex oracle over many texts built from fragments
that interact (stray tags, unclosed blocks, invalid JSON, whitespace), each fed in many random splits.
"""

from __future__ import annotations

import json
import logging
import random
import re
from typing import Any

import llguidance
import pytest

from specserve.backends.llama_cpp_vocab import LlamaCppVocabulary
from specserve.server.tool_calls import StreamingToolParser
from specserve.server.tool_grammar import tool_choice_grammar
from specserve.server.tool_stream import ToolParsing
from specserve.structured.tokenizer import llg_tokenizer
from support.tiny_models import TinyModels

NAMES = frozenset({"get_weather", "noop"})
PARSING = ToolParsing(NAMES)


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def call_json(name: str, args: Any) -> str:
    return json.dumps({"name": name, "arguments": args})


WEATHER = block(call_json("get_weather", {"city": "Paris"}))


def stripped(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Calls without their random ids: (name, decoded arguments)."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# --- parse -------------------------------------------------------------------------------------------------


def test_one_call_after_text() -> None:
    content, calls = PARSING.parse("Let me check.\n" + WEATHER + "\n")
    assert content == "Let me check."
    assert len(calls) == 1
    call = calls[0]
    assert set(call) == {"id", "type", "function"}
    assert re.fullmatch(r"call_[0-9a-f]{24}", call["id"])
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_several_calls_have_distinct_ids() -> None:
    text = WEATHER + "\n" + block(call_json("noop", {})) + "\n" + WEATHER
    content, calls = PARSING.parse(text)
    assert content == ""
    assert stripped(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("noop", {}),
        ("get_weather", {"city": "Paris"}),
    ]
    assert len({c["id"] for c in calls}) == 3


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"name": "noop", "parameters": {"a": 1}}', '{"a": 1}'),  # the other spelling models use
        ('{"name": "noop"}', "{}"),
        ('{"name": "noop", "arguments": null}', "{}"),
        ('{"name": "noop", "arguments": "{\\"a\\": 1}"}', '{"a": 1}'),  # JSON-encoded once more
        ('{"name": "noop", "arguments": {"city": "Zürich"}}', '{"city": "Zürich"}'),  # not \\u-escaped
        ('{"name":"noop","arguments":{"a":[1,2]}}', '{"a": [1, 2]}'),  # re-serialized json.dumps-style
    ],
)
def test_arguments_spellings(body: str, arguments: str) -> None:
    _, calls = PARSING.parse(block(body))
    assert [c["function"] for c in calls] == [{"name": "noop", "arguments": arguments}]


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        '{"name": "noop", "arguments": {"a": 1}',  # cut short
        '["noop"]',
        '{"name": 3, "arguments": {}}',
        '{"arguments": {}}',
        '{"name": "noop", "arguments": [1]}',
        '{"name": "noop", "arguments": "not json"}',
        '{"name": "noop", "arguments": "[1]"}',
    ],
)
def test_invalid_block_stays_in_content(body: str) -> None:
    text = "Before " + block(body) + " after " + WEATHER
    content, calls = PARSING.parse(text)
    assert content == "Before " + block(body) + " after"
    assert stripped(calls) == [("get_weather", {"city": "Paris"})]


def test_unclosed_block_and_stray_tags_stay_in_content() -> None:
    assert PARSING.parse("Hi " + WEATHER[:-3]) == ("Hi " + WEATHER[:-3], [])
    assert PARSING.parse("a </tool_call> b <tool") == ("a </tool_call> b <tool", [])
    # A block runs to the first end tag: a nested start makes the outer block invalid, text kept.
    nested = "<tool_call>oops " + WEATHER
    assert PARSING.parse(nested) == (nested, [])


def test_plain_text_is_stripped_only() -> None:
    assert PARSING.parse("  \n Hello,\n\n world \n") == ("Hello,\n\n world", [])
    assert PARSING.parse("") == ("", [])


def test_unknown_tool_is_returned_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="specserve.server"):
        _, calls = PARSING.parse(block(call_json("rm_rf", {"path": "/"})))
    assert stripped(calls) == [("rm_rf", {"path": "/"})]
    assert "rm_rf" in caplog.text


# --- streaming ---------------------------------------------------------------------------------------------


def test_streaming_holds_back_possible_tags() -> None:
    stream = PARSING.streaming()
    assert stream.feed("Hello <") == ("Hello", [])  # the space is held too: it may turn out to be trailing
    assert stream.feed("tool") == ("", [])
    assert stream.feed("s are fun <tool_call>\n{") == (" <tools are fun", [])
    assert stream.feed('"name": "noop"}\n</tool_') == ("", [])
    content, calls = stream.feed("call>\n")
    assert content == ""
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "noop")]
    assert stream.finish() == ("", [])


def test_streaming_indexes_and_finish_flushes_unclosed_block() -> None:
    stream = StreamingToolParser(NAMES)
    content, calls = stream.feed(WEATHER + "\n" + block(call_json("noop", {})) + "\nand <tool_call>{")
    assert content == "and"
    assert [c["index"] for c in calls] == [0, 1]
    assert stream.feed('"name"') == ("", [])
    assert stream.finish() == (' <tool_call>{"name"', [])


FRAGMENTS = [
    "Hello",
    " ",
    "\n",
    "\n\n",
    "Zürich ☀",
    "<",
    "<tool",
    "<tool_call>",
    "</tool_call>",
    "</tool",
    "<tools>",
    WEATHER,
    block(call_json("noop", {})),
    block('{"name": "noop", "parameters": {"x": [1, {"y": "</tool"}]}}'),
    block("not json"),
    block('{"name": 1}'),
    "<tool_call>" + call_json("get_weather", {"city": "Oslo"}) + "</tool_call>",  # no newlines: still a call
]

BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def oracle_call(body: str) -> tuple[str, Any] | None:
    """(name, arguments) of a block body per the documented rules (the fragments never JSON-encode
    arguments as a string), or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    args = {} if args is None else args
    return (obj["name"], args) if isinstance(args, dict) else None


def oracle(text: str) -> tuple[str, list[tuple[str, Any]]]:
    calls = [c for c in (oracle_call(m.group(1)) for m in BLOCK.finditer(text)) if c is not None]
    content = BLOCK.sub(lambda m: "" if oracle_call(m.group(1)) else m.group(0), text)
    return content.strip(), calls


def random_split(rng: random.Random, text: str) -> list[str]:
    if rng.random() < 0.2:
        return list(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if text else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream_all(pieces: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    stream = PARSING.streaming()
    contents, calls = [], []
    for piece in [*pieces, None]:
        content, done = stream.feed(piece) if piece is not None else stream.finish()
        contents.append(content)
        calls.extend(done)
    return contents, calls


def test_streaming_matches_parse_and_oracle_in_any_split() -> None:
    rng = random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 8)))
        content, calls = PARSING.parse(text)
        assert (content, stripped(calls)) == oracle(text), text
        for pieces in [list(text), *(random_split(rng, text) for _ in range(6))]:
            contents, streamed = stream_all(pieces)
            assert "".join(contents) == content, (text, pieces)
            assert stripped(streamed) == stripped(calls), (text, pieces)
            assert [c["index"] for c in streamed] == list(range(len(calls)))
            # Never a whitespace-only chunk: whitespace is sent only before content that follows it.
            assert all(c == "" or c.strip() for c in contents), (text, pieces)


# --- tool_choice grammar -----------------------------------------------------------------------------------

PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city"],
    "$defs": {"unit": {"enum": ["c", "f"]}},
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "A } in text", "parameters": PARAMS},
    },
    {"type": "function", "function": {"name": "noop"}},  # no parameters: any object
]


def compiled(grammar: str) -> str:
    g = llguidance.LLMatcher.grammar_from_lark(grammar)
    assert llguidance.LLMatcher.validate_grammar(g) == ""
    return str(g)


@pytest.mark.parametrize("choice", ["required", "get_weather", "noop"])
def test_grammar_compiles(choice: str) -> None:
    compiled(tool_choice_grammar(TOOLS, choice))


def test_grammar_rejects_unknown_choice() -> None:
    with pytest.raises(ValueError, match="not among the tools"):
        tool_choice_grammar(TOOLS, "rm_rf")
    with pytest.raises(ValueError, match="at least one"):
        tool_choice_grammar([], "required")


@pytest.fixture(scope="module")
def matcher_for(tiny_models: TinyModels) -> Any:
    vocab = LlamaCppVocabulary(tiny_models.target)
    tokenizer, _ = llg_tokenizer(vocab, vocab.vocab_size)

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, compiled(grammar), log_level=0)
        matcher.consume_tokens(vocab.tokenize(text, add_special=False))
        return not matcher.is_error() and bool(matcher.is_accepting())

    return accepts


W_SPACED = block('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}')
W_COMPACT = block('{"name":"get_weather","arguments":{"city":"Paris"}}')
NOOP = block('{"name": "noop", "arguments": {"anything": [1, {"x": null}]}}')


@pytest.mark.parametrize(
    ("choice", "text", "ok"),
    [
        ("required", W_SPACED, True),
        ("required", W_COMPACT, True),
        ("required", block('{ "name" : "noop" , "arguments" : { } }'), True),
        ("required", W_SPACED + "\n" + NOOP + "\n" + W_COMPACT, True),
        ("required", "", False),  # at least one call
        ("required", "Sure! " + W_SPACED, False),  # no text
        ("required", W_SPACED + NOOP, False),  # blocks separated by one newline
        ("required", W_SPACED + "\n", False),
        ("required", W_SPACED[:-1], False),  # unfinished
        ("required", block('{"name": "other", "arguments": {}}'), False),
        ("required", block('{"name": "get_weather", "arguments": {"unit": "c"}}'), False),  # city required
        (
            "required",
            block('{"name": "get_weather", "arguments": {"city": "P", "unit": "k"}}'),
            False,
        ),  # $ref
        ("required", block('{"name": "noop", "arguments": []}'), False),
        ("required", block('{"name": "noop"}'), False),
        ("required", block('{"arguments": {}, "name": "noop"}'), False),  # name first
        ("required", block('{"name": "noop", "arguments": {}, "x": 1}'), False),
        ("required", block('{"name":\n"noop", "arguments": {}}'), False),  # at most one space between tokens
        ("required", block('{"name":  "noop", "arguments": {}}'), False),
        ("get_weather", W_SPACED, True),
        ("get_weather", NOOP, False),
        ("get_weather", W_SPACED + "\n" + W_SPACED, False),  # exactly one call
        ("noop", NOOP, True),
    ],
)
def test_grammar_accepts_only_valid_calls(matcher_for: Any, choice: str, text: str, ok: bool) -> None:
    assert matcher_for(tool_choice_grammar(TOOLS, choice), text) is ok


def test_grammar_output_parses_back() -> None:
    text = W_SPACED + "\n" + NOOP
    content, calls = PARSING.parse(text)
    assert content == ""
    assert stripped(calls) == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("noop", {"anything": [1, {"x": None}]}),
    ]


@pytest.mark.parametrize(
    ("text", "call"),
    [
        ('```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```', True),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', True),
        ('  {"name": "get_weather", "parameters": {}}  ', True),
        ('{"name": "not_offered", "arguments": {}}', False),
        ('```python\nprint("hi")\n```', False),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}} and more', False),
        ("```json\n[1, 2]\n```", False),
    ],
)
def test_a_bare_json_call_naming_an_offered_tool(text: str, call: bool) -> None:
    """Qwen2.5-Coder's habit: the call as a bare (or fenced) JSON object; only offered names count."""
    parsing = ToolParsing(frozenset({"get_weather"}))
    content, calls = parsing.parse(text)
    assert bool(calls) is call
    assert content == ("" if call else text.strip())
    if call:
        assert calls[0]["function"]["name"] == "get_weather"
    for size in (1, 3, 7):
        stream = parsing.streaming()
        pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
        tail = stream.finish()
        assert "".join(c for c, _ in [*pieces, tail]) == content
        assert len([x for _, cs in [*pieces, tail] for x in cs]) == len(calls)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('{{"name": "get_weather", "arguments": {"city": "Paris"}}}', ["get_weather"]),
        ('```json\n{{"name": "noop", "arguments": {}}}\n```', ["noop"]),
        (
            '```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "noop"}]\n```',
            ["get_weather", "noop"],
        ),
        ('[{"name": "noop", "arguments": {}}]', ["noop"]),
        ('<tool_call>\n{{"name": "noop", "arguments": {}}}\n</tool_call>', ["noop"]),
        ('[{"name": "noop", "arguments": {}}, {"name": "other", "arguments": {}}]', []),  # one not offered
        ("[1, 2, 3]", []),
        ("[see the docs](https://example.com)", []),
        ("{{not json}}", []),
    ],
)
def test_every_spelling_of_calls_the_model_family_writes(text: str, names: list[str]) -> None:
    """Doubled braces (Qwen2.5's template shows the call so), arrays of calls, bare or fenced."""
    content, calls = PARSING.parse(text)
    assert [c["function"]["name"] for c in calls] == names
    assert content == ("" if names else text.strip())
    stream = PARSING.streaming()
    pieces = [stream.feed(text[i : i + 3]) for i in range(0, len(text), 3)] + [stream.finish()]
    assert "".join(p[0] for p in pieces) == content
    assert [c["function"]["name"] for p in pieces for c in p[1]] == names
