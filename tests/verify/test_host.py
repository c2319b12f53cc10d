"""The host verifier: a whole step's rows back to back, greedy and sampled sequences mixed, against the naive
oracles one sequence at a time."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.request import SamplingParams
from specserve.verify import VerifyRequest, verifier_for
from specserve.verify.host import HostVerifier
from specserve.verify.sampling import filter_logits_to_probs

from .reference import verify_greedy_ref, verify_rejection_ref

VOCAB = 12
GREEDY = SamplingParams()


def random_step(rng: np.random.Generator, ks: list[int]) -> tuple[np.ndarray, list[list[int]]]:
    """Logits of a step (each sequence's k + 1 rows back to back) and drafts that often agree with them."""
    logits = rng.normal(size=(sum(k + 1 for k in ks), VOCAB)).astype(np.float32)
    drafts, row = [], 0
    for k in ks:
        choices = logits[row : row + k].argmax(axis=1)
        drafts.append([int(c) if rng.random() < 0.7 else int(rng.integers(VOCAB)) for c in choices])
        row += k + 1
    return logits, drafts


@pytest.mark.parametrize("seed", range(20))
def test_a_greedy_step_equals_each_sequence_verified_alone(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ks = [int(k) for k in rng.integers(0, 6, size=int(rng.integers(1, 6)))]
    logits, drafts = random_step(rng, ks)
    emitted = HostVerifier().verify(logits, [VerifyRequest(d, GREEDY) for d in drafts])
    row = 0
    for k, draft, tokens in zip(ks, drafts, emitted, strict=True):
        rows = logits[row : row + k + 1][None]
        padded = np.array([draft], dtype=np.int64).reshape(1, k)
        assert tokens == verify_greedy_ref(padded, np.array([k]), rows)[0]
        row += k + 1


def test_greedy_and_sampled_sequences_in_one_step() -> None:
    """Each sampled sequence is filtered with its own knobs; the greedy ones keep the batched argmax."""
    rng = np.random.default_rng(7)
    ks = [3, 0, 2, 4]
    logits, drafts = random_step(rng, ks)
    hot = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1)
    draft_probs = rng.dirichlet(np.ones(VOCAB), size=4)  # [4, vocab]: the drafter's distributions
    requests = [
        VerifyRequest(drafts[0], GREEDY),
        VerifyRequest(drafts[1], hot, None, rng.random(0), rng.random(1)),
        VerifyRequest(drafts[2], GREEDY),
        VerifyRequest(drafts[3], hot, draft_probs, rng.random(4), rng.random(5)),
    ]
    emitted = HostVerifier().verify(logits, requests)
    starts = np.cumsum([0, *(k + 1 for k in ks)])
    for b, request in enumerate(requests):
        rows, k = logits[starts[b] : starts[b + 1]], ks[b]
        ids = np.array([request.draft_ids], dtype=np.int64).reshape(1, k)
        if request.params.greedy:
            expected = verify_greedy_ref(ids, np.array([k]), rows[None])[0]
        else:
            p = request.params
            probs = filter_logits_to_probs(rows, p.temperature, p.top_k, p.top_p, p.min_p)[None]
            assert request.sample_uniforms is not None
            expected = verify_rejection_ref(
                ids,
                np.array([k]),
                probs,
                None if request.draft_probs is None else request.draft_probs[None],
                None if request.accept_uniforms is None else request.accept_uniforms[None],
                request.sample_uniforms[None],
            )[0]
        assert emitted[b] == expected, b


def test_rows_must_match_the_requests() -> None:
    logits = np.zeros((3, VOCAB), np.float32)
    with pytest.raises(ValueError, match="3 rows"):
        HostVerifier().verify(logits, [VerifyRequest([1, 2, 3], GREEDY)])  # needs 4 rows
    with pytest.raises(ValueError, match="sample uniforms"):
        HostVerifier().verify(logits[:1], [VerifyRequest([], SamplingParams(temperature=1.0))])


def test_a_verifier_for_where_the_logits_are() -> None:
    assert isinstance(verifier_for("cpu"), HostVerifier)
    with pytest.raises(ValueError, match="no verifier for logits on 'tpu'"):
        verifier_for("tpu")
