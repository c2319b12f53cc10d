"""What one sequence brings to the step's verification: its rows in the step's logits and its
:class:`VerifyRequest` (drafts, sampling, the position's uniforms, what its grammar and penalties change)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.engine.draft_policy import DraftPlan
from specserve.request import ACCEPT_STREAM, SAMPLE_STREAM
from specserve.sequence import Sequence
from specserve.structured.grammar import GrammarState
from specserve.verify import VerifyRequest
from specserve.verify.adjust import build_adjustment


@dataclass(frozen=True)
class Emitting:
    """A sequence that emits tokens this step: where its logits rows are and what to verify."""

    seq: Sequence
    chunk: int
    """Its chunk in the step's decode (its rows: ``logits[chunk]``)."""
    request: VerifyRequest
    plan: DraftPlan | None
    """The draft plan of a decoding sequence; None for the first token after a prompt."""
    error: Exception | None = None
    """Building its request failed (its grammar, say): it fails alone at commit; ``request`` then only keeps
    the step's rows aligned."""


def verify_request(seq: Sequence, drafts: list[int], draft_probs: Any) -> VerifyRequest:
    """What the verifier needs of one sequence: its drafts, its sampling, the position's uniforms, and
    what its grammar and penalties change in each of its rows."""
    masks = seq.grammar.row_masks(drafts) if isinstance(seq.grammar, GrammarState) else None
    adjustment = build_adjustment(seq.params, seq.prompt_ids, seq.output_ids, drafts, masks)
    if seq.params.greedy:
        return VerifyRequest(drafts, seq.params, adjustment=adjustment)
    position, k = len(seq.output_ids), len(drafts)
    accept = seq.uniforms.take(ACCEPT_STREAM, position, k)
    sample = seq.uniforms.take(SAMPLE_STREAM, position, k + 1)
    return VerifyRequest(drafts, seq.params, draft_probs, accept, sample, adjustment)
