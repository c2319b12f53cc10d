"""A drafter that fails on purpose, for tests of the engine's fallback to plain decoding."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.sequence import Sequence


class ExplodingDrafter(Drafter):
    """Proposes garbage once, then raises on every call: requests must go on as plain decoding."""

    name = "exploding"

    def __init__(self) -> None:
        self.calls = 0

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        return DraftOption(min(limit, 3))

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        self.calls += 1
        if self.calls == 1:
            return [Proposal([7] * k) for k in num_tokens]
        raise RuntimeError("drafter bug")
