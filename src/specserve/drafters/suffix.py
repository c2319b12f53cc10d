"""Suffix decoding: draft the most frequent continuation of the context's suffix, from the request's own
prompt and output and from its tenant's recent outputs (SuffixDecoding, arXiv 2411.04975).

Where the n-gram drafter copies what followed the longest earlier match in the request, this drafter
remembers across requests: an agent re-emits the file it read, restates its plan, repeats a JSON shape
across a batch of extractions and runs the same task again, and each of those continues text that some
earlier output (or the prompt) already holds. Per step it finds the occurrences of the context's last
tokens in the request's own document and in its tenant's (``suffix_cache.py``), and walks them
(``suffix_index.py``): the draft is a chain (a CPU verify row costs most of a step: no trees), at most
``factor × match length`` tokens, stopped where the cumulative estimate falls under ``min_prob``.

Every drafted token carries its estimate (``DraftOption.token_probs``): the cost policy prices the draft from
it instead of a bucket's prior, so a long confident match drafts long and a weak one drafts nothing. Drafts
are deterministic (one-hot), so sampled output keeps the target's distribution exactly.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from specserve.config import (
    SUFFIX_CACHE_REQUESTS,
    SUFFIX_CACHE_TOKENS,
    SUFFIX_DEPTH,
    SUFFIX_FACTOR,
    SUFFIX_MIN_PROB,
)
from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.drafters.ngram import match_bucket
from specserve.drafters.registry import DrafterContext
from specserve.drafters.suffix_cache import SuffixCache
from specserve.drafters.suffix_index import EMPTY_WALK, Document, Occurrence, Walk, best_walk, match_length
from specserve.sequence import Sequence, SequenceStatus

KEY_LEN = 2
"""Tokens of the context looked up in the index; occurrences are then extended backwards to the depth."""
OCCURRENCES_PER_DOCUMENT = 32
"""Latest occurrences taken from one document (a common pair like ``\\n    `` occurs thousands of times)."""
MAX_OCCURRENCES = 128
"""Occurrences walked per step over all documents (the walk is linear in them)."""


@dataclass
class _State:
    doc: Document
    tenant: str
    walk: Walk = EMPTY_WALK
    """The draft ``available`` found, which ``propose`` hands out."""
    shared: bool = False
    """The document is visible to the tenant's other requests (from its first output token on: a request
    still waiting has nothing to offer them)."""


class SuffixDrafter(Drafter):
    """Model-free drafter over the request's context and its tenant's recent outputs."""

    name = "suffix"
    covers = frozenset({"ngram"})
    """It matches the same context suffixes as the n-gram drafter (and the tenant's recent outputs), with an
    estimate per token from how often each continuation followed the match. Offered beside it under
    ``auto``, the policy took the n-gram drafter's long drafts after short matches on its coarser bucket
    estimate: on the agent traces at concurrency 4 (Xeon AVX-512) 48 n-gram drafts kept 51 % of their tokens
    where 171 suffix drafts kept 77 %, and auto ran 1.07x plain against suffix alone 1.15x."""

    def __init__(
        self,
        depth: int = SUFFIX_DEPTH,
        factor: float = SUFFIX_FACTOR,
        min_prob: float = SUFFIX_MIN_PROB,
        cache_requests: int = SUFFIX_CACHE_REQUESTS,
        cache_tokens: int = SUFFIX_CACHE_TOKENS,
    ) -> None:
        if depth < KEY_LEN:
            raise ValueError(f"suffix depth must be >= {KEY_LEN}, got {depth}")
        self.depth = depth
        self.factor = factor
        self.min_prob = min_prob
        self.cache = SuffixCache(cache_requests, cache_tokens, KEY_LEN, context_tokens=depth)

    def begin(self, seq: Sequence) -> None:
        doc = Document(KEY_LEN, continuation_start=len(seq.prompt_ids))
        doc.extend(list(seq.prompt_ids))
        seq.drafter_state[self.name] = _State(doc, seq.cache_salt)

    def _state(self, seq: Sequence) -> _State:
        state = seq.drafter_state.get(self.name)
        if not isinstance(state, _State):
            self.begin(seq)
            state = seq.drafter_state[self.name]
            assert isinstance(state, _State)
        return state

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        state = self._state(seq)
        doc = state.doc
        seen = len(doc.tokens) - len(seq.prompt_ids)
        if seen < len(seq.output_ids):
            doc.extend(seq.output_ids[seen:])
            if not state.shared:
                self.cache.add_live(state.tenant, seq.request_id, doc)
                state.shared = True
        state.walk = EMPTY_WALK
        if limit <= 0 or len(doc.tokens) <= KEY_LEN:
            return DraftOption(0)
        walk = best_walk(self._occurrences(state, seq.request_id), limit, self.factor, self.min_prob)
        if not walk.token_ids:
            return DraftOption(0)
        state.walk = walk
        return DraftOption(len(walk.token_ids), match_bucket(walk.match_len), token_probs=walk.conditional)

    def _occurrences(self, state: _State, request_id: str) -> list[Occurrence]:
        """Where the context's last tokens occur: its own document first (anywhere), then its tenant's."""
        context = state.doc.tokens
        key = tuple(context[-KEY_LEN:])
        found: list[Occurrence] = []
        for doc in (state.doc, *self.cache.documents(state.tenant, request_id)):
            start = 0 if doc is state.doc else None  # its own prompt too; others' outputs only
            for pos in doc.occurrences(
                key, min(OCCURRENCES_PER_DOCUMENT, MAX_OCCURRENCES - len(found)), start
            ):
                found.append(Occurrence(doc, pos, match_length(context, doc, pos, self.depth)))
            if len(found) >= MAX_OCCURRENCES:
                break
        return found

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        return [
            Proposal(list(self._state(seq).walk.token_ids[: max(k, 0)]))
            for seq, k in zip(seqs, num_tokens, strict=True)
        ]

    def release(self, seq: Sequence) -> None:
        """Drop the request's document; a finished request's output joins its tenant's cache."""
        state = seq.drafter_state.pop(self.name, None)
        if not isinstance(state, _State):
            return
        self.cache.drop_live(state.tenant, seq.request_id)
        if seq.status is SequenceStatus.FINISHED and seq.output_ids:
            stopped = seq.finish_reason == "stop"
            self.cache.add_finished(state.tenant, seq.prompt_ids[-self.depth :], seq.output_ids, stopped)

    def close(self) -> None:
        self.cache.clear()


def build(context: DrafterContext) -> Drafter:
    return SuffixDrafter(
        context.suffix_depth,
        context.suffix_factor,
        context.suffix_min_prob,
        context.suffix_cache_requests,
        context.suffix_cache_tokens,
    )
