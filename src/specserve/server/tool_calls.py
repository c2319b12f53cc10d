"""OpenAI tool calls from the Hermes-format text Qwen2.5 writes, when no grammar shaped them.

Qwen2.5's chat template tells the model to answer a tool call as a block of text (no special tokens)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

possibly several blocks, possibly after ordinary text. :class:`StreamingToolParser` turns a generation
into ``(content, tool_calls)`` delta by delta, holding back only what
might still turn out to be a call. Both follow vLLM's Hermes parser where it is sound (a block runs from a
``<tool_call>`` to the first ``</tool_call>`` after it; ``"parameters"`` is accepted for ``"arguments"``;
calls to names the request did not offer are still returned) and differ where it loses text: a block that is
not a valid call, or is never closed, stays in the content verbatim instead of being dropped.

The grammars that make the model write only valid calls are in :mod:`specserve.server.tool_grammar`.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

log = logging.getLogger("specserve.server")

START = "<tool_call>"
END = "</tool_call>"


def _json(body: str) -> Any:
    """The JSON value ``body`` spells, also in the doubled braces of Qwen2.5's template (``{{...}}``); None
    if it spells none."""
    body = body.strip()
    for text in (body, body[1:-1]) if body.startswith("{{") and body.endswith("}}") else (body,):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            continue
    return None


def _call(body: str) -> dict[str, Any] | None:
    """The OpenAI tool call a block's body spells, or None if it spells none (the block is then content)."""
    return _call_of(_json(body))


def _call_of(obj: Any) -> dict[str, Any] | None:
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


def may_be_bare(text: str) -> bool:
    """Whether an output that starts so could still be a bare JSON call (held back until it ends)."""
    start = text.lstrip()
    if start.startswith("["):  # an array of calls, not a Markdown link or a list of numbers
        rest = start[1:].lstrip()
        return not rest or rest.startswith("{")
    return not start or start.startswith(("{", FENCE)) or FENCE.startswith(start)


def _bare_calls(text: str, tool_names: frozenset[str]) -> list[dict[str, Any]] | None:
    """A whole output that is calls naming offered tools, bare or in a Markdown code fence: one object, one
    in doubled braces, or an array of them; None if it is anything else.

    Qwen2.5-Coder answers a tool prompt so (a ``json`` fence, ``{"name", "arguments"}``, or the template's
    ``{{...}}``) instead of the ``<tool_call>`` tags its template asks for; every name must be one the
    request offers, so ordinary JSON output is not taken for a call.
    """
    body = text.strip()
    if body.startswith(FENCE):
        first_line_end = body.find("\n")
        if first_line_end < 0 or not body.endswith(FENCE) or len(body) < 2 * len(FENCE):
            return None
        body = body[first_line_end + 1 : -len(FENCE)].strip()
    if not body.startswith(("{", "[")):
        return None
    value = _json(body)
    calls = [_call_of(item) for item in (value if isinstance(value, list) else [value])]
    if not calls or any(c is None or c["function"]["name"] not in tool_names for c in calls):
        return None
    return [c for c in calls if c is not None]


def partial_start(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``<tool_call>`` (may become one)."""
    for size in range(min(len(text), len(START) - 1), 0, -1):
        if text.endswith(START[:size]):
            return size
    return 0


class StreamingToolParser:
    """One streamed generation's content and tool calls, delta by delta.

    Guarantee: for any split of a text into deltas, the content that ``feed`` and ``finish`` return
    concatenates to exactly the content of the whole text fed at once (its leading and trailing whitespace
    included: whitespace is held until non-space content follows, so no whitespace-only chunk is sent between
    or after tool calls), and the calls come in the same order with the same names and arguments (ids are
    random), each with an ``"index"`` 0, 1, ... as OpenAI's streamed ``tool_calls`` deltas carry. A call is
    returned whole by the delta that closes its block, never piecemeal. Held back at any time: a possible
    start of ``<tool_call>`` at the end of the text, everything from an open ``<tool_call>`` on, and trailing
    whitespace. When the request offers tools, an output that begins with ``{`` or a code fence is held
    whole: at its end it is either bare calls (:func:`_bare_calls`) or scanned as text.
    """

    def __init__(self, tool_names: frozenset[str] = frozenset()) -> None:
        self._tool_names = tool_names
        self._buffer = ""  # text not yet decided: a partial START, or a block from START on
        self._in_block = False
        self._searched = 0  # in a block: END does not start before this offset of the buffer
        self._spacing = Spacing()
        self._calls = 0
        self._held: str | None = "" if tool_names else None  # an output that may be a bare JSON call

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """(content that is safe to send now, the tool calls that this delta completed)."""
        if self._held is not None:
            self._held += delta
            if may_be_bare(self._held):
                return "", []
            delta, self._held = self._held, None  # not a bare call: scan it as any text
        self._buffer += delta
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if not self._in_block:
                at = self._buffer.find(START)
                if at < 0:
                    cut = len(self._buffer) - partial_start(self._buffer)
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
        return self._spacing.content("".join(content)), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest, at the end of generation: a block never closed (or a partial tag) is content."""
        if self._held is not None:
            held, self._held = self._held, None
            bare = _bare_calls(held, self._tool_names)
            if bare is not None:
                return "", [self._numbered(call) for call in bare]
            head, calls = self.feed(held)
            tail, more = self.finish()
            return head + tail, calls + more
        rest, self._buffer, self._in_block = self._buffer, "", False
        return self._spacing.last(rest), []

    def _numbered(self, call: dict[str, Any]) -> dict[str, Any]:
        warn_if_not_offered(call["function"]["name"], self._tool_names)
        self._calls += 1
        return {"index": self._calls - 1, **call}


def warn_if_not_offered(name: str, tool_names: frozenset[str]) -> None:
    if name not in tool_names:
        # Returned anyway, as vLLM does: the client sees what the model asked for and can answer with an
        # error message; dropping it would silently turn a tool call into an empty answer.
        log.warning("the model called tool %r, which the request does not offer", name)


class Spacing:
    """Content as it may be sent, delta by delta: leading whitespace dropped, trailing whitespace held back
    until more content follows (so no whitespace-only chunk goes out between or after tool calls)."""

    def __init__(self) -> None:
        self._space = ""  # whitespace after the content sent so far
        self._sent = False  # whether any content was sent (whitespace before it is dropped)

    def content(self, text: str) -> str:
        text = self._space + text
        if not self._sent:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        self._sent = self._sent or bool(body)
        return body

    def last(self, text: str) -> str:
        """The final piece: its trailing whitespace is dropped, as a whole parse strips it."""
        body = self.content(text)
        self._space = ""
        return body
