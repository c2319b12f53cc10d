"""Engine-wide counters (the metrics layer exports them; counters only grow)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from specserve.engine.sequence import Sequence


@dataclass
class EngineStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    drafter_failures: int = 0
    finished: Counter[str] = field(default_factory=Counter)

    def record_verify(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.append(0)
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    def record_finish(self, seq: Sequence) -> None:
        self.finished[seq.finish_reason or "unknown"] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
