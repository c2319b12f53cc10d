"""Model-free drafting by prompt lookup: copy what followed an earlier occurrence of the current suffix.

Costs microseconds, so it pays whenever its proposals are accepted often enough to cover the extra verify
positions — which happens on text that repeats its input (code edits, extraction, quoting summaries).

Per request an index maps every ``min_n``-gram of prompt + output to the positions just after it. To draft,
the engine's last ``min_n`` tokens are looked up; each earlier occurrence is extended backwards to measure how
long the match really is; the longest match wins (ties: the latest), and the tokens that followed it are
proposed. The match length is reported as the acceptance bucket: a 20-token match predicts a copy region far
better than a 2-token one, and the length policy learns the acceptance of each bucket.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.drafters.registry import DrafterContext
from specserve.drafters.suffix_index import index_continuations
from specserve.sequence import Sequence

_BUCKET_EDGES = (2, 4, 8, 16)  # match length buckets: <=2, 3-4, 5-8, 9-16, 17+
_MAX_CANDIDATES = 16  # how many earlier occurrences to extend (latest first)
_MATCH_SLICE = 16  # tokens compared at once when extending a match backwards


def match_bucket(match_len: int) -> str:
    for edge in _BUCKET_EDGES:
        if match_len <= edge:
            return f"match<={edge}"
    return f"match>{_BUCKET_EDGES[-1]}"


@dataclass
class _NgramIndex:
    min_n: int
    positions: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    indexed: int = 0  # tokens[:indexed] are in the index
    match_start: int = -1  # where the continuation of the last lookup starts (-1: none)

    def update(self, tokens: list[int]) -> None:
        self.indexed = index_continuations(self.positions, tokens, self.indexed, self.min_n)


class NgramDrafter(Drafter):
    """Prompt-lookup drafter (model-free; proposals are verified as one-hot drafts)."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_match: int = 64) -> None:
        if min_n < 1:
            raise ValueError("ngram min_n must be >= 1")
        self.min_n = min_n
        self.max_match = max_match

    def begin(self, seq: Sequence) -> None:
        seq.drafter_state[self.name] = _NgramIndex(self.min_n)

    def _index(self, seq: Sequence) -> _NgramIndex:
        index = seq.drafter_state.get(self.name)
        if not isinstance(index, _NgramIndex):
            index = _NgramIndex(self.min_n)
            seq.drafter_state[self.name] = index
        return index

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        index = self._index(seq)
        tokens = seq.tokens
        index.update(tokens)
        index.match_start = -1
        n = self.min_n
        if limit <= 0 or len(tokens) <= n:
            return DraftOption(0)
        candidates = index.positions.get(tuple(tokens[-n:]), [])
        best_len, best_start = 0, -1
        for start in reversed(candidates[-_MAX_CANDIDATES:]):
            length = self._match_length(tokens, start)
            if length > best_len:
                best_len, best_start = length, start
        if best_start < 0:
            return DraftOption(0)
        index.match_start = best_start
        return DraftOption(min(limit, len(tokens) - best_start), match_bucket(best_len))

    def _match_length(self, tokens: list[int], start: int) -> int:
        """How many tokens before ``start`` equal the tokens before the end (at least min_n by the index),
        at most ``max_match`` and ``start``. Compared a slice at a time: long copies match in full at 16
        candidates per step, and a token at a time that was a Python loop of 1,000 turns."""
        length, end = self.min_n, len(tokens)
        cap = min(self.max_match, start)
        while length < cap:
            step = min(_MATCH_SLICE, cap - length)
            ours = tokens[start - length - step : start - length]
            theirs = tokens[end - length - step : end - length]
            if ours == theirs:
                length += step
                continue
            i = step - 1
            while ours[i] == theirs[i]:  # the first mismatch going back; there is one
                i -= 1
            return length + step - 1 - i
        return length

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        proposals = []
        for seq, k in zip(seqs, num_tokens, strict=True):
            start = self._index(seq).match_start
            if start < 0 or k <= 0:
                proposals.append(Proposal([]))
                continue
            tokens = seq.tokens
            proposals.append(Proposal(tokens[start : start + k]))
        return proposals

    def release(self, seq: Sequence) -> None:
        seq.drafter_state.pop(self.name, None)


def build(context: DrafterContext) -> Drafter:
    return NgramDrafter(min_n=context.ngram_min_n)
