"""Drafting what the grammar forces: a constrained request's next tokens when its grammar allows only one
continuation (JSON braces, keys and separators, the rest of an enum value, a regex's literal parts).

It is not a drafter a user picks: the engine offers it beside the others for every request with a grammar,
and the cost-aware policy chooses it as any other (its acceptance is measured under its own name). Its
proposals are verified like any draft; under the grammar's mask the target's distribution at a forced
position has one token, so a forced draft is accepted unless the grammar's canonical tokenization differs
from the one allowed.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.sequence import Sequence
from specserve.structured.grammar import GrammarError, GrammarState

FORCED_BUCKET = "forced"


class GrammarDrafter(Drafter):
    """Proposes the tokens a sequence's grammar forces next (one-hot drafts)."""

    name = "grammar"

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        state = seq.grammar
        if not isinstance(state, GrammarState):
            return DraftOption(0)
        try:
            forced = state.forced(limit)
        except GrammarError:  # the request fails on its own at its next mask; nothing to draft
            return DraftOption(0)
        seq.drafter_state[self.name] = forced
        return DraftOption(len(forced), FORCED_BUCKET)

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        proposals = []
        for seq, n in zip(seqs, num_tokens, strict=True):
            forced = seq.drafter_state.pop(self.name, [])
            assert isinstance(forced, list)
            proposals.append(Proposal(forced[:n]))
        return proposals
