"""The lazy grammar of ``tool_choice: "auto"``: which texts start a call, which calls it then allows, and the
lazy grammar state the engine keeps (free until the trigger, masked from its start on), without a server."""

from __future__ import annotations

import re
from typing import Any

import llguidance
import numpy as np
import pytest

from specserve.backends.llama_cpp_vocab import LlamaCppVocabulary
from specserve.request import GrammarSpec
from specserve.server.tool_grammar import auto_tool_grammar
from specserve.structured.grammar import GrammarCompiler, LazyGrammarState, llg_grammar
from support.tiny_models import TinyModels

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: any object
]
SPEC = auto_tool_grammar(TOOLS)
SINGLE = auto_tool_grammar(TOOLS, parallel=False)
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {}}'
QWEN_FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'

CALLS = [  # (the output from the trigger's start on, allowed by the parallel grammar, by the single-call one)
    (f"<tool_call>\n{WEATHER}\n</tool_call>", True, True),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>", True, False),
    (QWEN_FENCED, True, True),
    ("{" + WEATHER + "}", True, True),  # the template's doubled braces, as the model copies them
    (WEATHER, True, True),
    (f"  {WEATHER}\n", True, True),
    (f"```json\n[{WEATHER}, {TIME}]\n```", True, False),
    (f"[{WEATHER}]", True, True),
    ('{"name": "get_weather", "arguments": {"unit": "c"}}', False, False),  # city is required
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}', False, False),
    ('{"name": "get_weather", "arguments": {"city": "Paris"}, "x": 1}', False, False),
    ('{"name": "get_weathers", "arguments": {}}', False, False),
    (f"{WEATHER} and then some text", False, False),
    (f"<tool_call>\n{WEATHER}\n</tool_call> and some text", False, False),
]


@pytest.fixture(scope="module")
def compiler(tiny_models: TinyModels) -> GrammarCompiler:
    vocab = LlamaCppVocabulary(tiny_models.target)
    return GrammarCompiler(vocab, vocab.vocab_size)


def _accepts(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    matcher = llguidance.LLMatcher(compiler.tokenizer(), llg_grammar(spec), log_level=0)
    matcher.consume_tokens(compiler.tokenizer().tokenize_str(text))
    return not matcher.is_error() and bool(matcher.is_accepting())


@pytest.mark.parametrize(("text", "parallel", "single"), CALLS)
def test_the_grammar_allows_only_valid_calls_in_every_spelling(
    compiler: GrammarCompiler, text: str, parallel: bool, single: bool
) -> None:
    assert SPEC is not None and SINGLE is not None
    assert _accepts(compiler, SPEC, text) is parallel
    assert _accepts(compiler, SINGLE, text) is single


def _trigger_start(text: str) -> int | None:
    assert SPEC is not None
    starts = [m.start() for t in SPEC.triggers if (m := re.search(t.encode(), text.encode())) is not None]
    return min(starts) if starts else None


@pytest.mark.parametrize(
    ("text", "start"),
    [
        ("Let me check.\n<tool_call>", 14),
        ('```json\n{\n  "name": "get_weather"', 0),
        ('  {{"name": "get_time"', 0),
        ('[ {"name": "get_time"', 0),
        ('{"name": "get_weather"', 0),
        ('{"name": "get_weat', None),  # not yet a whole offered name
        ('{"name": "Alice", "age": 3}', None),  # JSON output with a "name" key
        ('Here it is: {"name": "get_weather"', None),  # a bare object counts at the start only
        ("```python\nprint(1)\n```", None),
    ],
)
def test_a_call_starts_at_its_trigger(text: str, start: int | None) -> None:
    assert _trigger_start(text) == start


def test_every_trigger_match_is_accepted_by_the_grammar(compiler: GrammarCompiler) -> None:
    """The grammar takes each spelling from its trigger's start (else the output would stay free)."""
    for text, ok, _ in CALLS:
        if ok:
            at = _trigger_start(text)
            assert at is not None, text
            assert _accepts(compiler, SPEC, text[at:]), text  # type: ignore[arg-type]


def _ids(compiler: GrammarCompiler, text: str) -> list[int]:
    return list(compiler.tokenizer().tokenize_str(text))


def test_the_lazy_state_is_free_until_its_trigger_then_masks(compiler: GrammarCompiler) -> None:
    assert SPEC is not None
    state = compiler.state(SPEC)
    assert isinstance(state, LazyGrammarState)
    prose = _ids(compiler, "I will look it up. ")
    assert (state.row_masks(prose) == -1).all()  # free text: every row allows everything
    state.commit(prose)
    assert not state.active and state.forced(8) == []
    call = _ids(compiler, f"<tool_call>\n{WEATHER}\n</tool_call>")
    # A draft run that crosses the trigger: rows up to the one after "<tool_call>" completes are free, the
    # next ones are the grammar's (compared with a state that committed the same tokens).
    tag_end = next(j for j in range(1, len(call) + 1) if _trigger_start_in(compiler, prose + call[:j]))
    masks = state.row_masks(call)
    assert (masks[:tag_end] == -1).all() and not (masks[tag_end] == -1).all()
    committed = compiler.state(SPEC)
    committed.commit(prose + call[:tag_end])
    assert isinstance(committed, LazyGrammarState) and committed.active
    np.testing.assert_array_equal(committed.row_masks(call[tag_end:]), masks[tag_end:])
    state.commit(call)
    after = state.row_masks([])[0]
    assert _allows(after, _ids(compiler, "\n")[0]) and not _allows(after, _ids(compiler, "x")[0])


def _allows(row: Any, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _trigger_start_in(compiler: GrammarCompiler, ids: list[int]) -> bool:
    return _trigger_start(bytes(compiler.tokenizer().decode_bytes(ids)).decode()) is not None


def test_no_function_tools_no_grammar() -> None:
    assert auto_tool_grammar([]) is None
    assert auto_tool_grammar([{"type": "web_search"}]) is None


def test_a_trigger_after_a_long_text_still_fires_and_an_anchored_one_does_not(
    compiler: GrammarCompiler,
) -> None:
    """The lazy state keeps only the output's last bytes: a tag after 5,000 characters of prose starts the
    grammar, a bare call there is prose (the bare spellings count at the start only)."""
    assert SPEC is not None
    prose = _ids(compiler, "word " * 1000)
    tagged, bare = compiler.state(SPEC), compiler.state(SPEC)
    for state, call in ((tagged, f"<tool_call>\n{WEATHER}"), (bare, WEATHER)):
        assert isinstance(state, LazyGrammarState)
        for token in prose:
            state.commit([token])
        state.commit(_ids(compiler, call))
    assert tagged.active and not bare.active  # type: ignore[attr-defined]
