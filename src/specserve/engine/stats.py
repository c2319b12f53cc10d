"""Engine-wide counters (the metrics layer exports them; counters only grow)."""

from __future__ import annotations

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

    def record_finish(self, seq: Sequence) -> None:
        self.finished[seq.finish_reason or "unknown"] += 1
