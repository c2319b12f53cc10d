"""One request inside the engine: its tokens, its KV accounting, its speculation statistics.

Token accounting (the engine owns it; runtimes only store what they are told)::

    tokens = prompt_ids + output_ids
    target KV holds tokens[:num_computed]; tokens[num_computed:] are not evaluated yet.

After prefill ``num_computed == len(tokens) - 1``: the last token is *pending*, it is the first token of the
next verify batch. Rolling back rejected drafts is ``num_computed = new_length`` plus a KV truncate.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from specserve.request import PositionalUniforms, SamplingParams
from specserve.structured.grammar import GrammarState
from specserve.verify.logprobs import PromptLogprob

FinishReason = Literal["stop", "length", "abort", "error"]
"""``stop``: an end-of-generation or stop token, a grammar's end, or a stop string; ``length``: ``max_tokens``
or the context; ``abort``: the client went away or its deadline passed; ``error``: the engine failed this
request alone."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class AcceptanceCounts:
    """Speculation counters (vLLM's names). Mean acceptance length = 1 + accepted / drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Count one verify step that checked ``num_draft_tokens`` drafts and accepted ``num_accepted``."""
        assert 0 <= num_accepted <= num_draft_tokens
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


@dataclass
class SpecStats(AcceptanceCounts):
    """One request's speculation counters, plus what its log line reports."""

    first_rejections: list[int] = field(default_factory=list)
    drafts_by_drafter: dict[str, int] = field(default_factory=dict)
    """Drafts per drafter name (for logs: which drafters a request used)."""
    accepted_by_drafter: dict[str, int] = field(default_factory=dict)
    """Accepted draft tokens per drafter name (e.g. the share of an output its grammar forced)."""

    def record(self, num_draft_tokens: int, num_accepted: int, drafter: str | None = None) -> None:
        super().record(num_draft_tokens, num_accepted)
        if num_draft_tokens == 0:
            return
        if drafter is not None:
            self.drafts_by_drafter[drafter] = self.drafts_by_drafter.get(drafter, 0) + 1
            self.accepted_by_drafter[drafter] = self.accepted_by_drafter.get(drafter, 0) + num_accepted
        if num_accepted < num_draft_tokens and len(self.first_rejections) < 32:
            self.first_rejections.append(num_accepted)

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "drafts_by_drafter": dict(self.drafts_by_drafter),
            "accepted_by_drafter": dict(self.accepted_by_drafter),
        }


@dataclass
class SpeculationOptions:
    """Per-request override of the engine's speculation settings (None = engine default)."""

    enabled: bool | None = None
    drafter: str | None = None
    num_draft_tokens: int | None = None


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    uniforms: PositionalUniforms
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int = -1
    num_computed: int = 0
    cache_salt: str = ""
    """Prefix-cache namespace: requests reuse each other's KV only if their salts are equal."""
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (OpenAI's usage.prompt_tokens_details)."""
    finish_reason: FinishReason | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    drafter_state: dict[str, object] = field(default_factory=dict)
    grammar: GrammarState | None = None
    """The request's grammar state when its output is constrained (its masks shape the verify rows)."""
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)
    """Per prompt token, its logprobs (None for the first), when asked."""
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None
    """When the sequence got a KV slot (queue time = scheduled_time - arrival_time)."""
    first_token_time: float | None = None
    finish_time: float | None = None
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        """Prompt tokens remain to be evaluated (the last prompt token is evaluated by prefill too)."""
        return not self.output_ids and self.num_computed < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: FinishReason) -> None:
        assert self.status is not SequenceStatus.FINISHED, "a sequence finishes once"
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()


def decode_timings(
    first_token_time: float | None, num_output: int, start: float, end: float
) -> dict[str, float]:
    """What ``specserve generate --json`` reports of a request added at ``start`` and done at ``end``
    (``time.perf_counter``): prompt ms (to the first token), decode ms and decode tokens/s (the first token
    excluded)."""
    prefill_end = first_token_time or end
    generate_s = max(end - prefill_end, 1e-9)
    return {
        "prompt_ms": round((prefill_end - start) * 1000, 2),
        "generate_ms": round(generate_s * 1000, 2),
        "tokens_per_second": round(max(num_output - 1, 0) / generate_s, 3),
    }
