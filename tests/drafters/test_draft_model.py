"""The draft model drafter against a target whose logits are wider or narrower than the draft's (padded
vocabularies: Qwen2.5-7B has 152064 rows, 0.5B 151936): it proposes only ids the target has, and its draft
probabilities are distributions at the target's width, as lossless verification needs."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.drafters.draft_model import DraftModelDrafter
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import Sequence
from support.tiny_models import TinyModels


@pytest.mark.parametrize("target_width", [200, 400])
def test_proposals_fit_the_targets_vocabulary(tiny_models: TinyModels, target_width: int) -> None:
    runtime = LlamaCppRuntime(tiny_models.draft, context_per_sequence=256, n_threads=1)
    drafter = DraftModelDrafter(runtime, p_min=0.0, target_vocab_size=target_width)
    try:
        prompt = runtime.tokenize("def add(self, other):\n    return self.value + other.value\n")
        proposed: list[int] = []
        for seed in range(6):
            params = SamplingParams(temperature=1.5, max_tokens=8, seed=seed)
            seq = Sequence(f"r{seed}", prompt, params, PositionalUniforms(seed))
            seq.slot = 0
            drafter.begin(seq)
            (proposal,) = drafter.propose([seq], [6])
            drafter.release(seq)
            runtime.free(0)
            assert proposal.draft_probs is not None
            assert proposal.draft_probs.shape == (len(proposal.token_ids), target_width)
            assert np.allclose(proposal.draft_probs.sum(axis=1), 1.0)
            for token, probs in zip(proposal.token_ids, proposal.draft_probs, strict=True):
                assert token < target_width and probs[token] > 0
            proposed += proposal.token_ids
        assert proposed
    finally:
        runtime.close()
