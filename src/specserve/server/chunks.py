"""One response's bodies: its stream chunks (``chat.completion.chunk`` / ``text_completion``, with the
choice's ``index``, logprobs and tool-call deltas) and its whole non-streamed body."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve.engine.engine import RequestOutput
from specserve.sequence import Sequence, SpecStats
from specserve.server import responses as r
from specserve.server.logprobs_format import chat_logprobs, completion_logprobs
from specserve.server.tool_stream import ToolParsing
from specserve.verify.logprobs import TokenLogprobs


@dataclass(frozen=True)
class ChunkFormat:
    """Builds one response: its stream chunks (``*.chunk`` / ``text_completion``) or its whole body.

    ``token_bytes`` spells logprobs' tokens; ``echo`` is the prompt text a completion starts with."""

    chat: bool
    id: str
    created: int
    model: str
    include_usage: bool
    token_bytes: Callable[[int], bytes] | None = None
    echo: str = ""
    tools: ToolParsing | None = None

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

    def logprobs(self, entries: list[TokenLogprobs], offset: int = 0) -> dict[str, Any] | None:
        if self.token_bytes is None:
            return None
        if self.chat:
            return chat_logprobs(self.token_bytes, entries)
        return completion_logprobs(self.token_bytes, entries, offset)

    def opening(self, index: int) -> dict[str, Any] | None:
        if self.chat:
            return self._chunk(index, {"delta": {"role": "assistant", "content": ""}})
        return self._chunk(index, {"text": self.echo}) if self.echo else None

    def delta(self, index: int, text: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return self._chunk(
            index, {"delta": {"content": text}} if self.chat else {"text": text}, None, logprobs
        )

    def tool_delta(self, index: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        return self._chunk(index, {"delta": {"tool_calls": calls}})

    def finish(self, index: int, reason: str | None, speculative: dict[str, float | int]) -> dict[str, Any]:
        chunk = self._chunk(index, {"delta": {}} if self.chat else {"text": ""}, reason)
        chunk["speculative"] = speculative
        return chunk

    def usage(self, seqs: list[Sequence]) -> dict[str, Any]:
        chunk = self._chunk(0, {})
        chunk["choices"] = []
        chunk["usage"] = r.Usage.of(seqs).model_dump()
        return chunk

    def response(self, results: list[tuple[str, RequestOutput, list[TokenLogprobs]]]) -> dict[str, Any]:
        """The non-streamed response body (``chat.completion`` or ``text_completion``)."""
        seqs = [out.seq for _, out, _ in results]
        common = {"id": self.id, "created": self.created, "model": self.model, "usage": r.Usage.of(seqs)}
        stats = seqs[0].stats.as_dict() if len(seqs) == 1 else _merged_stats(seqs)
        response: r.CompletionResponse | r.ChatCompletionResponse
        if self.chat:
            choices = []
            for i, (text, out, entries) in enumerate(results):
                message, reason = self._message(text, out.seq.finish_reason)
                logprobs = self.logprobs(entries)
                choices.append(
                    r.ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason)
                )
            response = r.ChatCompletionResponse.model_validate(
                {**common, "choices": choices, "speculative": stats}
            )
        else:
            completion_choices = [
                r.CompletionChoice(
                    index=i,
                    text=self.echo + text,
                    logprobs=self.logprobs(entries, len(self.echo)),
                    finish_reason=out.seq.finish_reason,
                )
                for i, (text, out, entries) in enumerate(results)
            ]
            response = r.CompletionResponse.model_validate(
                {**common, "choices": completion_choices, "speculative": stats}
            )
        return response.model_dump(exclude_none=False)

    def _message(self, text: str, reason: str | None) -> tuple[r.AssistantMessage, str | None]:
        if self.tools is None:
            return r.AssistantMessage(content=text), reason
        content, calls = self.tools.parse(text)
        if not calls:
            return r.AssistantMessage(content=content), reason
        tool_calls = [r.ToolCall.model_validate(c) for c in calls]
        message = r.AssistantMessage(content=content or None, tool_calls=tool_calls)
        return message, "tool_calls" if reason == "stop" else reason  # as streamed: a cut call says length


def _merged_stats(seqs: list[Sequence]) -> dict[str, Any]:
    total = SpecStats()
    for seq in seqs:
        total.num_drafts += seq.stats.num_drafts
        total.num_draft_tokens += seq.stats.num_draft_tokens
        total.num_accepted_tokens += seq.stats.num_accepted_tokens
        for name, count in seq.stats.drafts_by_drafter.items():
            total.drafts_by_drafter[name] = total.drafts_by_drafter.get(name, 0) + count
        for name, count in seq.stats.accepted_by_drafter.items():
            total.accepted_by_drafter[name] = total.accepted_by_drafter.get(name, 0) + count
    return total.as_dict()
