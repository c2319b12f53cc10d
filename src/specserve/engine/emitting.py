"""What one sequence brings to the step's verification: its rows in the step's logits and its
:class:`VerifyRequest` (drafts, sampling, the position's uniforms, what its grammar and penalties change);
and the logprobs of what the step's sequences emitted, from the rows that chose them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from specserve.backends.base import StepLogits
from specserve.engine.draft_policy import DraftPlan
from specserve.request import ACCEPT_STREAM, SAMPLE_STREAM
from specserve.sequence import Sequence
from specserve.structured.grammar import GrammarState
from specserve.verify import VerifyRequest
from specserve.verify.adjust import build_adjustment
from specserve.verify.logprobs import TokenLogprobs, step_token_logprobs

log = logging.getLogger(__name__)


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


def emitted_logprobs(
    emitting: list[Emitting], emitted: list[list[int] | Exception], logits: StepLogits[Any]
) -> list[list[TokenLogprobs] | Exception | None]:
    """The logprobs of each asking sequence's emitted tokens (None where it did not ask), from the rows that
    chose them: one call for the step (on a device one upload and one read for all); should that fail,
    each sequence alone, so that a failure stays with its request."""
    found: list[list[TokenLogprobs] | Exception | None] = [None] * len(emitting)
    asking: list[int] = []
    spans: list[tuple[int, list[int], int]] = []
    for i, (e, tokens) in enumerate(zip(emitting, emitted, strict=True)):
        top_n = e.seq.params.logprobs
        if top_n is not None and e.error is None and not isinstance(tokens, Exception):
            asking.append(i)
            spans.append((logits.offsets[e.chunk], tokens, top_n))
    if not spans:
        return found
    try:
        for i, entries in zip(asking, step_token_logprobs(logits.rows, spans), strict=True):
            found[i] = entries
        return found
    except Exception:
        log.warning("batched logprobs failed; computing each sequence's alone", exc_info=True)
    for i, span in zip(asking, spans, strict=True):
        try:
            found[i] = step_token_logprobs(logits.rows, [span])[0]
        except Exception as exc:
            found[i] = exc
    return found
