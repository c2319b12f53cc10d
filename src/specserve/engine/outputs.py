"""What the engine core hands out: per step and request, the new token ids — nothing shaped for a client.

An :class:`EngineOutput` is what crosses from the engine core to the output processor (over a socket when
the core runs in its own process, so every field pickles small): the ids the step appended, their raw
logprobs when asked, the request's prompt-side facts with its first output (:class:`RequestStart`) and its
counters with its last (:class:`RequestEnd`). Text, stop strings, tool calls and logprob formatting are the
output processor's (engine/output_processor.py), beside the API server.

Every request the core accepts gets exactly one last output (``finish_reason`` set): finished, aborted,
failed or refused. That is what lets the other side free its record of the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from specserve.sequence import FinishReason, Sequence, SpecStats
from specserve.verify.logprobs import PromptLogprob, TokenLogprobs

OutputFinish = FinishReason | Literal["refused"]
"""A sequence's finish reasons, and ``refused``: ``add_request`` refused the request (``EngineOutput.error``
says why: a 400)."""


@dataclass(frozen=True, slots=True)
class RequestStart:
    """A request's prompt-side facts, with its first output."""

    cached_tokens: int
    """Prompt tokens whose KV came from the prefix cache."""
    prompt_logprobs: list[PromptLogprob | None]
    """Per prompt token when the request asked (None for the first); else empty."""
    scheduled_time: float | None
    first_token_time: float | None
    """``time.perf_counter`` (CLOCK_MONOTONIC: one clock for every process of the machine)."""


@dataclass(frozen=True, slots=True)
class RequestEnd:
    """A request's counters, with its last output."""

    stats: SpecStats
    finish_time: float | None
    draft_seconds: float
    verify_seconds: float


@dataclass(slots=True)
class EngineOutput:
    """What one step produced for one request: ids appended to its output (never taken back)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: OutputFinish | None = None
    """Set on the request's last output, and only there."""
    new_logprobs: list[TokenLogprobs] | None = None
    """The new tokens' raw logprobs, one each, when the request asked for them."""
    start: RequestStart | None = None
    end: RequestEnd | None = None
    error: str | None = None
    """Why the request was refused (``finish_reason == "refused"``)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def request_start(seq: Sequence) -> RequestStart:
    return RequestStart(seq.cached_tokens, seq.prompt_logprobs, seq.scheduled_time, seq.first_token_time)


def request_end(seq: Sequence) -> RequestEnd:
    return RequestEnd(seq.stats, seq.finish_time, seq.draft_seconds, seq.verify_seconds)


def refused(request_id: str, reason: str) -> EngineOutput:
    """The last output of a request that ``add_request`` refused."""
    return EngineOutput(request_id, [], "refused", error=reason)
