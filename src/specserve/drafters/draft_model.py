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

from specserve.backends.base import BackendError, DecodeChunk, ModelRuntime, StepLogits, to_host
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
        self,
        runtime: ModelRuntime[Any],
        p_min: float = 0.6,
        target_vocab_size: int | None = None,
        target_logits_device: str = "cpu",
    ) -> None:
        self.runtime = runtime
        logits_device = runtime.info.logits_device
        self.on_device = logits_device.startswith("torch") and logits_device == target_logits_device
        """The draft's logits are tensors where the target's verifier reads them: tokens are chosen there
        and draft probabilities stay there (draft_model_device.py); otherwise rows come to the host."""
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
        probs: list[list[Any]] = [[] for _ in seqs]  # [vocab] float64 rows: numpy, or tensors on the device
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
            choices = self._next(logits, [seqs[i] for i in active], [len(drafts[i]) for i in active])
            still: list[int] = []
            for j, i in enumerate(active):
                seq, state = seqs[i], self._state(seqs[i])
                state.computed = seq.num_tokens + len(drafts[i])
                if drafts[i]:
                    state.decoded_drafts += 1
                choice = choices[j]
                if choice is None:  # not confident enough: the chain stops here
                    continue
                drafts[i].append(choice[0])
                if choice[1] is not None:
                    probs[i].append(choice[1])
                if len(drafts[i]) < num_tokens[i]:
                    still.append(i)
            active = still
            chunks = [
                DecodeChunk(seqs[i].slot, [drafts[i][-1]], seqs[i].num_tokens + len(drafts[i]) - 1, 1)
                for i in active
            ]
        return [Proposal(d, self._at_target_width(p)) for d, p in zip(drafts, probs, strict=True)]

    def _next(
        self, logits: StepLogits[Any], seqs: Seq[Sequence], drafted: Seq[int]
    ) -> list[tuple[int, Any] | None]:
        """Each sequence's next draft token and, sampled, its distribution at the target's width; None where
        the draft is not confident enough. Only the ids the target has are considered: the draft then
        samples from a distribution over the target's vocabulary, which is what lossless verification needs
        (padding rows differ between sizes)."""
        if self.on_device:  # the chain is sequential per token: one small read per step, not the rows
            from specserve.drafters.draft_model_device import choose_on_device

            rows = logits.rows[:, : self.target_vocab_size]
            tokens, confidence, rows_probs = choose_on_device(rows, seqs, drafted)
            if any(t < 0 for t in tokens):  # the device sampler's mark of a row without probability mass
                raise DrafterError("the draft model's logits have no finite value to sample from")
            chosen = zip(tokens, confidence, rows_probs, strict=True)
            return [None if c < self.p_min else (t, p) for t, c, p in chosen]
        host_rows = to_host(logits.rows)[:, : self.target_vocab_size]
        choices: list[tuple[int, Any] | None] = []
        for j, seq in enumerate(seqs):
            rows = host_rows[logits.offsets[j] : logits.offsets[j + 1]]
            choices.append(
                None if top_probability(rows[0]) < self.p_min else self._choose(seq, rows[:1], drafted[j])
            )
        return choices

    def _at_target_width(self, probs: list[Any]) -> Any:  # [k, target vocab] float64, numpy or a tensor
        """The draft's distributions at the target's width: ids only the target has get probability 0."""
        if not probs:
            return None
        if not isinstance(probs[0], np.ndarray):  # rows on the device (draft_model_device.py)
            import torch

            on_device = torch.stack(probs)
            return torch.nn.functional.pad(on_device, (0, self.target_vocab_size - on_device.shape[1]))
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
        index: int,  # drafts already made this proposal: the position's offset
    ) -> tuple[int, npt.NDArray[np.float64] | None]:
        if seq.params.greedy:
            return int(np.argmax(logits[0])), None
        probs = probs_from_params(logits, seq.params)  # [1, vocab]
        position = len(seq.output_ids) + index
        uniform = seq.uniforms.take(DRAFT_STREAM, position, 1)
        return int(sample_inverse_cdf(probs, uniform)[0]), probs[0]

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
        context.draft_runtime,
        p_min=context.draft_p_min,
        target_vocab_size=context.target_vocab_size,
        target_logits_device=context.target_logits_device,
    )
