"""The grammars of tool calls (Lark, llguidance's dialect): forced for ``tool_choice`` ``"required"`` or a
named function, lazy for ``"auto"``.

A forced grammar lets the model write nothing but Hermes blocks (``<tool_call>`` + JSON + ``</tool_call>``).
A lazy one (:func:`auto_tool_grammar`) leaves the output free until the model starts a call in a spelling the
Qwen family writes, as llama.cpp's server does (``common/chat.cpp``'s lazy grammars); from the start of that
call on, only valid calls of offered tools can follow, then the end:

* ``<tool_call>`` anywhere (its chat template's format);
* at the start of the output, optionally in a ``json`` code fence: ``{"name": "<tool>"``, the template's
  doubled-brace ``{{"name": "<tool>"`` (Qwen2.5's template shows the call as ``{{"name": <function-name>,
  "arguments": <args-json-object>}}``, a string literal the model copies), or ``[{"name": "<tool>"`` for
  several calls in one array.

The trigger waits for a whole offered name, so ordinary JSON output with a ``"name"`` key is left alone. The
distribution sampled is the target's, masked by the grammar from the trigger's start on, with speculation
or without (``structured.grammar.LazyGrammarState``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from specserve.request import GrammarSpec
from specserve.server.tool_calls import END, START

JSON_WHITESPACE: dict[str, Any] = {"whitespace_pattern": "[ ]?"}
"""llguidance's ``x-guidance`` options of a forced call's JSON: at most one space between tokens. That admits
both the compact spelling and the ``json.dumps`` one Qwen writes (``", "``, ``": "``), but not the unbounded
whitespace of ``%json``'s default, in which a sampled model can loop on spaces and newlines to max_tokens."""


def _rebase(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#/...``) pointing into ``base``, where it is being nested."""
    if isinstance(schema, list):
        return [_rebase(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {
        key: base + value[1:]
        if key == "$ref" and isinstance(value, str) and value.startswith("#")
        else _rebase(value, base)
        for key, value in schema.items()
    }


def _call_schema(function: dict[str, Any], base: str) -> dict[str, Any]:
    """JSON schema of one call, ``{"name": <this name>, "arguments": <its parameters>}``, at ``base``."""
    parameters = function.get("parameters") or {"type": "object"}  # no parameters: any object
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            "arguments": _rebase(parameters, base + "/properties/arguments"),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_choice_grammar(tools: list[dict[str, Any]], choice: str, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) for ``tool_choice``: ``"required"`` allows one or more calls of
    any tool (one when not ``parallel``: OpenAI's ``parallel_tool_calls: false``), a function's name exactly
    one call of it. ValueError if the name is not among ``tools`` (or
    there are no tools). A tool named ``"required"`` cannot be chosen by name; the word means any tool.

    The output is Hermes blocks separated by ``"\\n"``, each ``<tool_call>\\n`` + JSON + ``\\n</tool_call>``,
    exactly what :class:`ToolParsing` reads back. The JSON's keys come in the order ``name``, ``arguments``
    (llguidance fixes property order to the schema's), the order Qwen writes them in.
    """
    functions = _functions(tools)
    if choice == "required":
        chosen = list(functions.values())
        if not chosen:
            raise ValueError('tool_choice "required" needs at least one function tool')
    elif choice in functions:
        chosen = [functions[choice]]
    else:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")
    schema = _calls_schema(chosen, JSON_WHITESPACE)
    calls = 'call ("\\n" call)*' if choice == "required" and parallel else "call"
    # Quoted "<tool_call>": unquoted, <...> names a special token in llguidance's Lark, and it is text here.
    rules = [
        f"start: {calls}",
        f'call: "{START}\\n" call_json "\\n{END}"',
        f"call_json: %json {json.dumps(schema)}",
    ]
    return "\n".join(rules) + "\n"


CALL_WHITESPACE: dict[str, Any] = {"whitespace_pattern": "[ \t\n]{0,24}"}
"""The JSON whitespace of a lazily constrained call: what the model writes unconstrained (newlines and
indentation, Qwen2.5-Coder's habit), bounded per gap so a sampled model cannot loop on whitespace."""
SPACE = "[ \t\n]*"


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The function tools by name (the first of a repeated name); ValueError on a nameless one."""
    functions: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            continue
        if not isinstance(function.get("name"), str):
            raise ValueError("a function tool needs a string name")
        functions.setdefault(function["name"], function)
    return functions


def _calls_schema(chosen: list[dict[str, Any]], whitespace: dict[str, Any]) -> dict[str, Any]:
    if len(chosen) == 1:
        schema = _call_schema(chosen[0], "#")
    else:  # one %json of alternatives: separate %json rules would each be a lexeme class to pick up front
        schema = {"anyOf": [_call_schema(f, f"#/anyOf/{i}") for i, f in enumerate(chosen)]}
    schema["x-guidance"] = whitespace
    return schema


def auto_tool_grammar(tools: list[dict[str, Any]], parallel: bool = True) -> GrammarSpec | None:
    """The lazy grammar of ``tool_choice: "auto"`` (see the module docstring); None without function tools.
    ``parallel`` False (``parallel_tool_calls: false``) allows one call."""
    functions = _functions(tools)
    if not functions:
        return None
    array = 'call (WS? "," WS? call)*' if parallel else "call"
    rules = [
        "start: WS? calls WS?",
        "calls: tagged | fenced | body",
        f"tagged: tcall{' (WS? tcall)*' if parallel else ''}",
        f'tcall: "{START}" WS? call WS? "{END}"',
        'fenced: "```" "json"? WS? body WS? "```"',
        f'body: call | "{{" call "}}" | "[" WS? {array} WS? "]"',
        f"call: %json {json.dumps(_calls_schema(list(functions.values()), CALL_WHITESPACE))}",
        "WS: /[ \\t\\n]{1,16}/",
    ]
    names = "|".join(re.escape(name) for name in sorted(functions, key=len, reverse=True))
    fence, opening = rf"(?:```(?:json)?{SPACE})?", rf"(?:\[{SPACE}|\{{)?\{{"
    call = rf'\A{SPACE}{fence}{opening}{SPACE}"name"{SPACE}:{SPACE}"(?:{names})"'
    return GrammarSpec("grammar", "\n".join(rules) + "\n", triggers=(re.escape(START), call))
