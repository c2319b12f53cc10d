"""One response's bodies: its stream chunks (``chat.completion.chunk`` / ``text_completion``, with the
choice's ``index``, logprobs and tool-call deltas) and its whole non-streamed body."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.engine.output_processor import RequestOutput, RequestState
from specserve.sequence import SpecStats
from specserve.server import responses as r
from specserve.server.logprobs_format import (
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    vllm_prompt_logprobs,
)
from specserve.server.tool_stream import ToolParsing
from specserve.verify.logprobs import TokenLogprobs

_MARKER = "\ue000text\ue000"  # private-use characters: in no model name or response id


def sse(payload: dict[str, Any], ascii_only: bool = False) -> bytes:
    """One server-sent event of a chunk."""
    text = json.dumps(payload, ensure_ascii=ascii_only, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


@dataclass(frozen=True)
class PromptOutput:
    """What a response shows of its prompts."""

    echoes: tuple[str, ...] = ()
    """Per choice, the prompt text its completion starts with (``echo``); empty: no echo."""
    echo_logprobs: int | None = None
    """``echo`` with ``logprobs``: the echoed tokens' logprobs with this many alternatives."""
    prompt_logprobs: int | None = None
    """vLLM's ``prompt_logprobs`` with this many alternatives."""

    def echo(self, index: int) -> str:
        return self.echoes[index] if self.echoes else ""


@dataclass(frozen=True)
class ChunkFormat:
    """Builds one response: its stream chunks (``*.chunk`` / ``text_completion``) or its whole body.

    ``token_bytes`` spells the tokens of logprobs; ``logprobs``: the request asked for its output tokens'."""

    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool
    token_bytes: Callable[[int], bytes]
    logprobs: bool = False
    prompt: PromptOutput = PromptOutput()
    tools: ToolParsing | None = None
    n: int = 1
    """Choices per prompt (a completions request may hold several prompts)."""
    _around: dict[int, tuple[bytes, bytes]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """Per choice, a text delta's event before and after its text (``delta_event``)."""

    def _chunk(
        self, index: int, choice: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": index, **choice, "logprobs": logprobs, "finish_reason": finish_reason}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def output_logprobs(self, entries: list[TokenLogprobs], offset: int = 0) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.token_bytes, entries)
        return completion_logprobs(self.token_bytes, entries, offset)

    def opening(self, index: int) -> dict[str, Any] | None:
        """Chat's first chunk per choice (its role), sent before any output."""
        if self.chat:
            return self._chunk(index, {"delta": {"role": "assistant", "content": ""}})
        return None

    def prompt_chunk(self, index: int, request: RequestState) -> dict[str, Any] | None:
        """Sent with a choice's first output (once its prompt is evaluated): a completion's echo (and its
        tokens' logprobs), vLLM's ``prompt_logprobs``."""
        prompt = self._prompt_logprobs(request)
        if self.chat:
            return (
                None if prompt is None else {**self._chunk(index, {"delta": {}}), "prompt_logprobs": prompt}
            )
        echo = self.prompt.echo(index)
        if not echo and prompt is None:
            return None
        chunk = self._chunk(index, {"text": echo}, logprobs=self._echo_logprobs(request))
        if prompt is not None:
            chunk["choices"][0]["prompt_logprobs"] = prompt
        return chunk

    def _echo_logprobs(self, request: RequestState) -> dict[str, Any] | None:
        if self.prompt.echo_logprobs is None:
            return None
        return echoed_logprobs(
            self.token_bytes, request.prompt_ids, request.prompt_logprobs, self.prompt.echo_logprobs
        )

    def _prompt_logprobs(self, request: RequestState) -> list[Any] | None:
        if self.prompt.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.token_bytes, request.prompt_logprobs, self.prompt.prompt_logprobs)

    def delta(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._chunk(
            index, {"delta": {"content": text}} if self.chat else {"text": text}, None, logprobs
        )

    def delta_event(self, index: int, text: str) -> bytes:
        """``sse(self.delta(index, text))``, byte for byte, without building and encoding the chunk: the
        encoded chunk around its text is made once per choice (a streamed token's event, every token)."""
        around = self._around.get(index)
        if around is None:
            head, tail = sse(self.delta(index, _MARKER)).split(
                json.dumps(_MARKER, ensure_ascii=False).encode()
            )
            around = self._around[index] = (head, tail)
        return around[0] + json.dumps(text, ensure_ascii=False).encode() + around[1]

    def tool_delta(self, index: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return self._chunk(index, {"delta": {"tool_calls": calls}})

    def finish(self, index: int, reason: str | None, speculative: dict[str, float | int]) -> dict[str, Any]:
        chunk = self._chunk(index, {"delta": {}} if self.chat else {"text": ""}, reason)
        chunk["speculative"] = speculative
        return chunk

    def usage(self, requests: list[RequestState]) -> dict[str, Any]:
        chunk = self._chunk(0, {})
        chunk["choices"] = []
        chunk["usage"] = r.Usage.of(requests, self.n).model_dump()
        return chunk

    def response(self, results: list[tuple[str, RequestOutput, list[TokenLogprobs]]]) -> dict[str, Any]:
        """The non-streamed response body (``chat.completion`` or ``text_completion``)."""
        requests = [out.state for _, out, _ in results]
        common = {
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "usage": r.Usage.of(requests, self.n),
        }
        stats = requests[0].stats.as_dict() if len(requests) == 1 else _merged_stats(requests)
        response: r.CompletionResponse | r.ChatCompletionResponse
        if self.chat:
            choices = []
            for i, (text, out, entries) in enumerate(results):
                message, reason = self._message(text, out.state.finish_reason)
                logprobs = self.output_logprobs(entries)
                choices.append(
                    r.ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason)
                )
            response = r.ChatCompletionResponse.model_validate(
                {**common, "choices": choices, "speculative": stats}
            )
            prompt_logprobs = self._prompt_logprobs(requests[0])
            if prompt_logprobs is not None:
                response.prompt_logprobs = prompt_logprobs
        else:
            completion_choices = [self._completion_choice(i, *result) for i, result in enumerate(results)]
            response = r.CompletionResponse.model_validate(
                {**common, "choices": completion_choices, "speculative": stats}
            )
        return response.model_dump(exclude_none=False)

    def _completion_choice(
        self, index: int, text: str, out: RequestOutput, entries: list[TokenLogprobs]
    ) -> r.CompletionChoice:
        echo = self.prompt.echo(index)
        logprobs = self.output_logprobs(entries, len(echo))
        echoed = self._echo_logprobs(out.state)
        if logprobs is not None and echoed is not None:
            logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
        return r.CompletionChoice(
            index=index,
            text=echo + text,
            logprobs=logprobs,
            finish_reason=out.state.finish_reason,
            prompt_logprobs=self._prompt_logprobs(out.state),
        )

    def _message(self, text: str, reason: str | None) -> tuple[r.AssistantMessage, str | None]:
        if self.tools is None:
            return r.AssistantMessage(content=text), reason
        content, calls = self.tools.parse(text)
        if not calls:
            return r.AssistantMessage(content=content), reason
        tool_calls = [r.ToolCall.model_validate(c) for c in calls]
        message = r.AssistantMessage(content=content or None, tool_calls=tool_calls)
        return message, "tool_calls" if reason == "stop" else reason  # as streamed: a cut call says length


def _merged_stats(requests: list[RequestState]) -> dict[str, Any]:
    total = SpecStats()
    for request in requests:
        total.num_drafts += request.stats.num_drafts
        total.num_draft_tokens += request.stats.num_draft_tokens
        total.num_accepted_tokens += request.stats.num_accepted_tokens
        for name, count in request.stats.drafts_by_drafter.items():
            total.drafts_by_drafter[name] = total.drafts_by_drafter.get(name, 0) + count
        for name, count in request.stats.accepted_by_drafter.items():
            total.accepted_by_drafter[name] = total.accepted_by_drafter.get(name, 0) + count
    return total.as_dict()
