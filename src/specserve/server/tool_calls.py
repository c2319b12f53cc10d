"""OpenAI tool calls from the Hermes-format text Qwen2.5 writes, and the grammar that forces such calls.

Qwen2.5's chat template tells the model to answer a tool call as a block of text (no special tokens)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several blocks, possibly after ordinary text. :class:`ToolParsing` turns a finished generation into
``(content, tool_calls)``; :class:`StreamingToolParser` does the same delta by delta, holding back only what
might still turn out to be a call. Both follow vLLM's Hermes parser where it is sound (a block runs from a
``<tool_call>`` to the first ``</tool_call>`` after it; ``"parameters"`` is accepted for ``"arguments"``;
calls to names the request did not offer are still returned) and differ where it loses text: a block that is
not a valid call, or is never closed, stays in the content verbatim instead of being dropped.

:func:`tool_choice_grammar` is the other direction: for ``tool_choice`` ``"required"`` or a named function,
a Lark grammar for llguidance that lets the model write nothing but valid calls.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("specserve.server")

START = "<tool_call>"
END = "</tool_call>"

JSON_WHITESPACE: dict[str, Any] = {"whitespace_pattern": "[ ]?"}
"""llguidance's ``x-guidance`` options of a forced call's JSON: at most one space between tokens. That admits
both the compact spelling and the ``json.dumps`` one Qwen writes (``", "``, ``": "``), but not the unbounded
whitespace of ``%json``'s default, in which a sampled model can loop on spaces and newlines to max_tokens."""


def _call(body: str) -> dict[str, Any] | None:
    """The OpenAI tool call a block's body spells, or None if it spells none (the block is then content)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
    if isinstance(args, str):  # the object JSON-encoded once more, as OpenAI's own wire format has it
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):  # OpenAI's arguments are an object; anything else is not a call
        return None
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


FENCE = "```"


def _may_be_bare(text: str) -> bool:
    """Whether an output that starts so could still be a bare JSON call (held back until it ends)."""
    start = text.lstrip()
    return not start or start.startswith(("{", FENCE)) or FENCE.startswith(start)


def _bare_call(text: str, tool_names: frozenset[str]) -> dict[str, Any] | None:
    """A whole output that is one call object, bare or in a Markdown code fence, naming an offered tool.

    Qwen2.5-Coder answers a tool prompt so (``json`` fence, ``{"name", "arguments"}``) instead of the
    ``<tool_call>`` tags its template asks for; the name must be one the request offers, so ordinary JSON
    output is not taken for a call.
    """
    body = text.strip()
    if body.startswith(FENCE):
        first_line_end = body.find("\n")
        if first_line_end < 0 or not body.endswith(FENCE) or len(body) < 2 * len(FENCE):
            return None
        body = body[first_line_end + 1 : -len(FENCE)].strip()
    call = _call(body) if body.startswith("{") else None
    if call is None or call["function"]["name"] not in tool_names:
        return None
    return call


def _partial_start(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>`` (may become one)."""
    for size in range(min(len(text), len(START) - 1), 0, -1):
        if text.endswith(START[:size]):
            return size
    return 0


class StreamingToolParser:
    """One streamed generation's content and tool calls, delta by delta.

    Guarantee: for any split of a text into deltas, the content that ``feed`` and ``finish`` return
    concatenates to exactly ``ToolParsing.parse(text)[0]`` (leading and trailing whitespace of the content
    included: whitespace is held until non-space content follows, so no whitespace-only chunk is sent between
    or after tool calls), and the calls come in the same order with the same names and arguments (ids are
    random), each with an ``"index"`` 0, 1, ... as OpenAI's streamed ``tool_calls`` deltas carry. A call is
    returned whole by the delta that closes its block, never piecemeal. Held back at any time: a possible
    start of ``<tool_call>`` at the end of the text, everything from an open ``<tool_call>`` on, and trailing
    whitespace. When the request offers tools, an output that begins with ``{`` or a code fence is held
    whole: at its end it is either one bare call (:func:`_bare_call`) or scanned as text.
    """

    def __init__(self, tool_names: frozenset[str] = frozenset()) -> None:
        self._tool_names = tool_names
        self._buffer = ""  # text not yet decided: a partial START, or a block from START on
        self._in_block = False
        self._searched = 0  # in a block: END does not start before this offset of the buffer
        self._space = ""  # whitespace after the content sent so far, held until more content follows
        self._sent = False  # whether any content was sent (whitespace before it is dropped)
        self._calls = 0
        self._held: str | None = "" if tool_names else None  # an output that may be a bare JSON call

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content that is safe to send now, the tool calls that this delta completed)."""
        if self._held is not None:
            self._held += delta
            if _may_be_bare(self._held):
                return "", []
            delta, self._held = self._held, None  # not a bare call: scan it as any text
        self._buffer += delta
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if not self._in_block:
                at = self._buffer.find(START)
                if at < 0:
                    cut = len(self._buffer) - _partial_start(self._buffer)
                    content.append(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    break
                content.append(self._buffer[:at])
                self._buffer = self._buffer[at:]
                self._in_block, self._searched = True, len(START)
            end = self._buffer.find(END, self._searched)
            if end < 0:
                self._searched = max(self._searched, len(self._buffer) - len(END) + 1)
                break
            block, self._buffer = self._buffer[: end + len(END)], self._buffer[end + len(END) :]
            self._in_block = False
            call = _call(block[len(START) : end])
            if call is None:
                content.append(block)
            else:
                calls.append(self._numbered(call))
        return self._content("".join(content)), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest, at the end of generation: a block never closed (or a partial tag) is content."""
        if self._held is not None:
            held, self._held = self._held, None
            call = _bare_call(held, self._tool_names)
            if call is not None:
                return "", [self._numbered(call)]
            head, calls = self.feed(held)
            tail, more = self.finish()
            return head + tail, calls + more
        rest, self._buffer, self._in_block = self._buffer, "", False
        content = self._content(rest)
        self._space = ""  # trailing whitespace of the content is dropped, as parse() strips it
        return content, []

    def _numbered(self, call: dict[str, Any]) -> dict[str, Any]:
        name = call["function"]["name"]
        if name not in self._tool_names:
            # Returned anyway, as vLLM does: the client sees what the model asked for and can answer with
            # an error message; dropping it would silently turn a tool call into an empty answer.
            log.warning("the model called tool %r, which the request does not offer", name)
        self._calls += 1
        return {"index": self._calls - 1, **call}

    def _content(self, text: str) -> str:
        """``text`` as it may be sent: leading whitespace dropped, trailing whitespace held back."""
        text = self._space + text
        if not self._sent:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        self._sent = self._sent or bool(body)
        return body


@dataclass(frozen=True)
class ToolParsing:
    """Tool-call parsing for one request. ``tool_names`` are the functions it offers; a call to another name
    is still returned (as vLLM does) and logged as a warning, so the caller decides what to do with it."""

    tool_names: frozenset[str]

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, calls) of a finished generation.

        Content is the text outside complete, valid tool-call blocks, stripped of surrounding whitespace; a
        block that is not valid JSON, not an object with a string ``"name"``, has arguments that are not an
        object, or is never closed stays in it verbatim. Each call is ``{"id", "type": "function",
        "function": {"name", "arguments"}}`` with ``arguments`` the JSON text of the arguments object
        (``"{}"`` when the model wrote none).

        It is the streaming parser fed the whole text: one scanner, so the two never disagree.
        """
        stream = self.streaming()
        head, calls = stream.feed(text)
        tail, more = stream.finish()
        return head + tail, [{k: v for k, v in call.items() if k != "index"} for call in calls + more]

    def streaming(self) -> StreamingToolParser:
        return StreamingToolParser(self.tool_names)


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
    functions: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            continue
        if not isinstance(function.get("name"), str):
            raise ValueError("a function tool needs a string name")
        functions.setdefault(function["name"], function)
    if choice == "required":
        chosen = list(functions.values())
        if not chosen:
            raise ValueError('tool_choice "required" needs at least one function tool')
    elif choice in functions:
        chosen = [functions[choice]]
    else:
        raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")
    if len(chosen) == 1:
        schema = _call_schema(chosen[0], "#")
    else:  # one %json of alternatives: separate %json rules would each be a lexeme class to pick up front
        schema = {"anyOf": [_call_schema(f, f"#/anyOf/{i}") for i, f in enumerate(chosen)]}
    schema["x-guidance"] = JSON_WHITESPACE
    calls = 'call ("\\n" call)*' if choice == "required" and parallel else "call"
    # Quoted "<tool_call>": unquoted, <...> names a special token in llguidance's Lark, and it is text here.
    rules = [
        f"start: {calls}",
        f'call: "{START}\\n" call_json "\\n{END}"',
        f"call_json: %json {json.dumps(schema)}",
    ]
    return "\n".join(rules) + "\n"
