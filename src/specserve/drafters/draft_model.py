"""Chain drafting with a small model of the target's tokenizer family.

The draft model keeps its own KV cache per sequence (same slot ids as the target). Before drafting it
catches up on the tokens it has not seen (the pending token, and any tokens emitted while it was not used),
starting from what an earlier request left in the slot where that is a prefix of this one. Then it extends
the chain one token per batched decode. Drafting stops early when the draft's own confidence in its next
token falls below ``p_min``: an unconfident guess is likely rejected, and every proposed token costs a
verify position.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from specserve.backends.base import BackendError, DecodeChunk, ModelRuntime, to_host
from specserve.drafters.base import Drafter, DrafterError, DraftOption, Proposal
from specserve.drafters.registry import DrafterContext
from specserve.request import DRAFT_STREAM
from specserve.sequence import Sequence
from specserve.verify.sampling import probs_from_params, sample_inverse_cdf


@dataclass
class _DraftState:
    computed: int = 0  # the draft KV holds seq.tokens[:computed]
    placed: bool = False  # the slot's leftover KV from an earlier request was reused or cleared
    base_len: int = 0  # len(seq.tokens) when the last proposal was made
    decoded_drafts: int = 0  # draft tokens of that proposal that entered the draft KV


def top_probability(logits: npt.NDArray[np.float32]) -> float:
    """Probability of the most likely token under a plain softmax (the draft's confidence)."""
    shifted = np.exp(logits - logits.max(), dtype=np.float64)
    return float(1.0 / shifted.sum())


class DraftModelDrafter(Drafter):
    """Proposes the draft model's chain of next tokens."""

    name = "draft-model"
    uses_model = True

    def __init__(
        self, runtime: ModelRuntime[Any], p_min: float = 0.6, target_vocab_size: int | None = None
    ) -> None:
        self.runtime = runtime
        self.p_min = p_min
        self.target_vocab_size = target_vocab_size or runtime.info.vocab_size
        """The target's logits width (vocabularies may differ by padding, e.g. Qwen2.5-7B's 152064 rows
        against 0.5B's 151936): draft probabilities are given at that width, and an id the target does
        not have is never proposed."""
        self._left: dict[int, list[int]] = {}
        """Tokens whose draft KV a finished request left in each slot (the draft side of prefix caching:
        the next request in that slot starts from the common prefix)."""

    def begin(self, seq: Sequence) -> None:
        seq.drafter_state[self.name] = _DraftState()

    def _state(self, seq: Sequence) -> _DraftState:
        state = seq.drafter_state.get(self.name)
        if not isinstance(state, _DraftState):
            state = _DraftState()
            seq.drafter_state[self.name] = state
        return state

    def leftover(self, slot: int) -> list[int]:
        """The tokens whose draft KV a finished request left in ``slot`` (empty once reused)."""
        return list(self._left.get(slot, []))

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        return DraftOption(max(0, limit), setup_tokens=seq.num_tokens - self._state(seq).computed)

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        try:
            return self._propose(seqs, num_tokens)
        except BackendError as exc:
            raise DrafterError(f"draft model failed: {exc}") from exc

    def _propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[npt.NDArray[np.float64]]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        for i in active:
            state = self._state(seqs[i])
            if not state.placed:
                self._reuse_leftover(seqs[i], state)
            state.base_len = seqs[i].num_tokens
            state.decoded_drafts = 0
        # Round 0 evaluates each sequence's unseen tokens; later rounds evaluate the previous guess.
        chunks = []
        for i in active:
            seq, state = seqs[i], self._state(seqs[i])
            chunks.append(DecodeChunk(seq.slot, seq.tokens[state.computed :], state.computed, 1))
        while active:
            logits = self.runtime.decode(chunks)
            still: list[int] = []
            # A device runtime's rows come to the host here: the chain is sequential per token anyway.
            # Only the ids the target has: the draft then samples from a distribution over the target's
            # vocabulary, which is what lossless verification needs (padding rows differ between sizes).
            host_rows = to_host(logits.rows)[:, : self.target_vocab_size]
            for j, i in enumerate(active):
                rows = host_rows[logits.offsets[j] : logits.offsets[j + 1]]
                seq, state = seqs[i], self._state(seqs[i])
                state.computed = seq.num_tokens + len(drafts[i])
                if drafts[i]:
                    state.decoded_drafts += 1
                if top_probability(rows[0]) < self.p_min:
                    continue
                token = self._choose(seq, rows[:1], len(drafts[i]), probs[i])
                drafts[i].append(token)
                if len(drafts[i]) < num_tokens[i]:
                    still.append(i)
            active = still
            chunks = [
                DecodeChunk(seqs[i].slot, [drafts[i][-1]], seqs[i].num_tokens + len(drafts[i]) - 1, 1)
                for i in active
            ]
        return [Proposal(d, self._at_target_width(p)) for d, p in zip(drafts, probs, strict=True)]

    def _at_target_width(
        self, probs: list[npt.NDArray[np.float64]]
    ) -> npt.NDArray[np.float64] | None:  # [k, target vocab] float64
        """The draft's distributions at the target's width: ids only the target has get probability 0."""
        if not probs:
            return None
        stacked = np.stack(probs)
        return np.pad(stacked, ((0, 0), (0, self.target_vocab_size - stacked.shape[1])))

    def _reuse_leftover(self, seq: Sequence, state: _DraftState) -> None:
        """Keep the longest common prefix of what the slot holds (at least one token stays to evaluate)."""
        left = self._left.pop(seq.slot, [])
        tokens = seq.tokens
        keep = 0
        for a, b in zip(left, tokens[:-1], strict=False):
            if a != b:
                break
            keep += 1
        self.runtime.truncate(seq.slot, keep)
        state.computed, state.placed = keep, True

    def _choose(
        self,
        seq: Sequence,
        logits: npt.NDArray[np.float32],  # [1, vocab]
        index: int,
        probs_out: list[npt.NDArray[np.float64]],
    ) -> int:
        if seq.params.greedy:
            return int(np.argmax(logits[0]))
        probs = probs_from_params(logits, seq.params)  # [1, vocab]
        position = len(seq.output_ids) + index
        uniform = seq.uniforms.take(DRAFT_STREAM, position, 1)
        probs_out.append(probs[0])
        return int(sample_inverse_cdf(probs, uniform)[0])

    def accept(self, seq: Sequence, num_accepted: int) -> None:
        state = self._state(seq)
        # The draft KV holds the tokens before the proposal plus the draft tokens it evaluated; only those
        # the target accepted are still part of the sequence.
        valid = state.base_len + min(num_accepted, state.decoded_drafts)
        if state.computed > valid:
            self.runtime.truncate(seq.slot, valid)
            state.computed = valid

    def release(self, seq: Sequence) -> None:
        state = seq.drafter_state.pop(self.name, None)
        # A state never placed did not touch the slot: it still holds what the previous request left.
        if isinstance(state, _DraftState) and seq.slot >= 0 and state.placed:
            self._left[seq.slot] = seq.tokens[: state.computed]

    def close(self) -> None:
        self.runtime.close()


def build(context: DrafterContext) -> Drafter:
    if context.draft_runtime is None:
        raise DrafterError("the draft-model drafter needs a draft model (--draft), and none is loaded")
    return DraftModelDrafter(
        context.draft_runtime, p_min=context.draft_p_min, target_vocab_size=context.target_vocab_size
    )
