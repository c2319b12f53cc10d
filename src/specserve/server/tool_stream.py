"""One request's tool-call parsing (:class:`ToolParsing`), and calls streamed argument by argument where a
grammar guarantees their shape (:class:`GrammarToolStream`).

Under a tool grammar (``tool_choice`` ``auto``'s lazy one, or ``required``/named, see
:mod:`specserve.server.tool_grammar`) everything from the grammar's start on is calls, so a call can be
sent as it is generated, as OpenAI streams it: a first ``tool_calls`` delta with the call's ``index``,
``id``, ``type`` and ``name`` (``arguments`` empty), then ``{"index", "function": {"arguments": piece}}``
deltas as the arguments' text arrives. The arguments are the model's JSON with the whitespace between its
tokens written as ``json.dumps`` writes it (``", "`` and ``": "``, no newlines): the same text whether the
output is streamed or not, in whatever pieces it comes (one token or sixteen per engine step), because a
whole output is parsed by feeding the same scanner in one piece. Without such a grammar (tools with a
``response_format``) the Hermes parser of :mod:`specserve.server.tool_calls` applies: calls arrive whole.

Under a grammar a call cut off by ``max_tokens`` is returned as far as it got, streamed or not (its
arguments then are not complete JSON; ``finish_reason`` is ``length``).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from specserve.server.tool_calls import (
    Spacing,
    StreamingToolParser,
    may_be_bare,
    partial_start,
    warn_if_not_offered,
)
from specserve.structured.grammar import first_trigger

CALL_HEAD = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
"""A call's name and the start of its arguments (the grammar writes ``name`` first)."""


class _Arguments:
    """One call's arguments value, character by character: the text to send (whitespace between JSON
    tokens as ``json.dumps`` writes it) and whether the value has ended."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> tuple[str, int, bool]:
        """(text to send, characters of ``text`` used, whether the value ended with them)."""
        out: list[str] = []
        for used, char in enumerate(text, 1):
            if self.in_string:
                out.append(char)
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return "".join(out), used, True
                continue
            if char in " \t\r\n":
                continue
            if char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
            out.append({",": ", ", ":": ": "}.get(char, char))
            if self.depth <= 0 and char in "}]":
                return "".join(out), used, True
        return "".join(out), len(text), False


class _CallScanner:
    """The calls in text the grammar shaped: each call's head (name), then its arguments piece by piece.
    What surrounds the calls (tags, fences, brackets, doubled braces) is syntax, not content."""

    def __init__(self, tool_names: frozenset[str]) -> None:
        self._tool_names = tool_names
        self._text = ""
        self._at = 0  # scanned up to here
        self._arguments: _Arguments | None = None  # the call whose arguments are arriving
        self.calls = 0

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self._text += delta
        deltas: list[dict[str, Any]] = []
        while True:
            if self._arguments is None:
                head = CALL_HEAD.search(self._text, self._at)
                if head is None:
                    break
                name = json.loads(f'"{head.group(1)}"')
                warn_if_not_offered(name, self._tool_names)
                call_id = "call_" + secrets.token_hex(12)
                function = {"name": name, "arguments": ""}
                deltas.append({"index": self.calls, "id": call_id, "type": "function", "function": function})
                self.calls += 1
                self._at, self._arguments = head.end(), _Arguments()
            piece, used, ended = self._arguments.feed(self._text[self._at :])
            self._at += used
            if piece:
                deltas.append({"index": self.calls - 1, "function": {"arguments": piece}})
            if not ended:
                break
            self._arguments = None
        return deltas


class GrammarToolStream:
    """Content until the grammar's trigger, then calls (see the module docstring). ``triggers`` are the
    lazy grammar's (the same expressions over the text); ``forced``: the grammar applies from the start."""

    def __init__(self, tool_names: frozenset[str], triggers: tuple[str, ...], forced: bool) -> None:
        self._triggers = [re.compile(t) for t in triggers]
        self._text = ""
        self._released = 0  # characters of text handed on (as content, or to the calls)
        self._spacing = Spacing()
        self._calls = _CallScanner(tool_names)
        self._in_calls = forced

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content that is safe to send now, tool-call deltas)."""
        before, self._text = len(self._text), self._text + delta
        if self._in_calls:
            return "", self._to_calls(self._released)
        start = first_trigger(self._triggers, self._text, before)
        if start is not None:
            at = max(start, self._released)
            content = self._spacing.last(self._text[self._released : at])
            self._in_calls = True
            return content, self._to_calls(at)
        held = self._released == 0 and may_be_bare(self._text)  # it may yet start with a call
        cut = self._released if held else len(self._text) - partial_start(self._text)
        content, self._released = self._text[self._released : cut], max(cut, self._released)
        return self._spacing.content(content), []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self._in_calls:
            return "", []
        rest, self._released = self._text[self._released :], len(self._text)
        return self._spacing.last(rest), []

    def _to_calls(self, start: int) -> list[dict[str, Any]]:
        text, self._released = self._text[start:], len(self._text)
        return self._calls.feed(text)


@dataclass(frozen=True)
class ToolParsing:
    """Tool-call parsing for one request. ``tool_names`` are the functions it offers; a call to another name
    is still returned (as vLLM does) and logged as a warning, so the caller decides what to do with it.
    ``triggers`` (a lazy grammar's) or ``forced`` (a grammar from the first token): the output is shaped by
    a tool grammar and calls stream piece by piece (:class:`GrammarToolStream`)."""

    tool_names: frozenset[str]
    triggers: tuple[str, ...] = ()
    forced: bool = False

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, calls) of a finished generation.

        Without a grammar, content is the text outside complete, valid tool-call blocks, stripped of
        surrounding whitespace; a block that is not valid JSON, not an object with a string ``"name"``, has
        arguments that are not an object, or is never closed stays in it verbatim. Each call is ``{"id",
        "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` the JSON text of the
        arguments object (``"{}"`` when the model wrote none).

        It is the streaming parser fed the whole text: one scanner, so the two never disagree.
        """
        stream = self.streaming()
        head, deltas = stream.feed(text)
        tail, more = stream.finish()
        return head + tail, assemble(deltas + more)

    def streaming(self) -> StreamingToolParser | GrammarToolStream:
        if self.triggers or self.forced:
            return GrammarToolStream(self.tool_names, self.triggers, self.forced)
        return StreamingToolParser(self.tool_names)


def assemble(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Whole calls (without ``index``) from streamed ``tool_calls`` deltas, as a client assembles them."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = calls.get(delta["index"])
        if call is None:
            calls[delta["index"]] = {
                "id": delta["id"],
                "type": "function",
                "function": {"name": delta["function"]["name"], "arguments": delta["function"]["arguments"]},
            }
        else:
            call["function"]["arguments"] += delta["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def one_entry_per_call(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A delta's ``tool_calls`` with one entry per call ``index``, as OpenAI sends them (clients such as
    instructor read ``tool_calls[0]`` of each chunk): a call's head and the argument pieces that came in the
    same engine step are one entry, their arguments joined."""
    merged: list[dict[str, Any]] = []
    for call in calls:
        if merged and merged[-1]["index"] == call["index"]:
            last = merged[-1]
            function = {**last.get("function", {})}
            function["arguments"] = function.get("arguments", "") + call.get("function", {}).get(
                "arguments", ""
            )
            merged[-1] = {**last, "function": function}
        else:
            merged.append(call)
    return merged
