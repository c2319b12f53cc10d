"""Engine-wide counters (the metrics layer exports them; counters only grow)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from specserve.sequence import AcceptanceCounts, Sequence


@dataclass
class EngineStats(AcceptanceCounts):
    generated_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    drafter_failures: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    drafts_by_drafter: Counter[str] = field(default_factory=Counter)
    draft_tokens_by_drafter: Counter[str] = field(default_factory=Counter)
    accepted_by_drafter: Counter[str] = field(default_factory=Counter)
    """Verify steps with drafts, draft tokens and accepted tokens per drafter name (metrics by name)."""

    def record_drafter(self, name: str, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens > 0:
            self.drafts_by_drafter[name] += 1
            self.draft_tokens_by_drafter[name] += num_draft_tokens
            self.accepted_by_drafter[name] += num_accepted

    def snapshot(self) -> EngineStats:
        """A copy that later steps do not change (the metrics' last exported values), without deepcopy's
        walk: a copy each step was 5 % of the engine thread's time at a tiny model's step rate."""
        return dataclasses.replace(
            self,
            accepted_per_position=list(self.accepted_per_position),
            finished=Counter(self.finished),
            drafts_by_drafter=Counter(self.drafts_by_drafter),
            draft_tokens_by_drafter=Counter(self.draft_tokens_by_drafter),
            accepted_by_drafter=Counter(self.accepted_by_drafter),
        )

    def record_finish(self, seq: Sequence) -> None:
        self.finished[seq.finish_reason or "unknown"] += 1
