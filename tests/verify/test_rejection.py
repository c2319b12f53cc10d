"""Rejection sampling: exact hand-built cases and random batches against the naive oracle.

Convergence to the target distribution is tested in test_rejection_statistics.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from specserve.request import SAMPLE_STREAM, PositionalUniforms
from specserve.verify import (
    PLACEHOLDER_TOKEN_ID,
    VerifyResult,
    sample_inverse_cdf,
    verify_rejection,
)

from .reference import verify_rejection_ref

P = PLACEHOLDER_TOKEN_ID
TARGET = [0.1, 0.6, 0.2, 0.1]
DRAFT = [0.1, 0.3, 0.5, 0.1]  # target >= draft for tokens 0, 1, 3; token 2 is kept with probability 0.4


def rejection(
    drafts: list[list[int]],
    target_probs: list[list[list[float]]],
    draft_probs: list[list[list[float]]] | None,
    accept_uniforms: list[list[float]] | None,
    sample_uniforms: list[list[float]],
) -> VerifyResult:
    draft_token_ids = np.array(drafts, dtype=np.int64).reshape(len(drafts), -1)
    return verify_rejection(
        draft_token_ids,
        (draft_token_ids != P).sum(axis=1).astype(np.int64),
        np.array(target_probs, dtype=np.float64),
        None if draft_probs is None else np.array(draft_probs, dtype=np.float64),
        None if accept_uniforms is None else np.array(accept_uniforms, dtype=np.float64),
        np.array(sample_uniforms, dtype=np.float64),
    )


# --- exact cases with a draft model -----------------------------------------------------------------------


def test_drafts_the_target_likes_more_are_always_accepted_then_bonus() -> None:
    bonus_dist = [0.25, 0.25, 0.5, 0.0]
    result = rejection(
        [[1, 0]], [[TARGET, TARGET, bonus_dist]], [[DRAFT, DRAFT]], [[0.999, 0.999]], [[0, 0, 0.6]]
    )
    assert result.output_token_ids.tolist() == [[1, 0, 2]]
    assert result.num_accepted.tolist() == [2]


@pytest.mark.parametrize(("accept_u", "expected"), [(0.39, [[1, 2, 3]]), (0.41, [[1, 1, P]])])
def test_accept_test_is_u_below_target_over_draft(accept_u: float, expected: list[list[int]]) -> None:
    # Draft 2 at position 1: target/draft = 0.2/0.5 = 0.4. On rejection the residual max(target - draft, 0)
    # is [0, 0.3, 0, 0], so the recovered token is 1 whatever the sample uniform.
    bonus_dist = [0.0, 0.0, 0.0, 1.0]
    result = rejection(
        [[1, 2]], [[TARGET, TARGET, bonus_dist]], [[DRAFT, DRAFT]], [[0.5, accept_u]], [[0.9, 0.9, 0.9]]
    )
    assert result.output_token_ids.tolist() == expected


def test_recovered_token_is_drawn_from_the_residual() -> None:
    target, draft = [0.4, 0.1, 0.3, 0.2], [0.1, 0.6, 0.1, 0.2]  # residual [0.3, 0, 0.2, 0] / 0.5
    for sample_u, recovered in [(0.0, 0), (0.59, 0), (0.61, 2), (0.99, 2)]:
        result = rejection([[1]], [[target, TARGET]], [[draft]], [[0.9]], [[sample_u, 0.0]])
        assert result.tokens(0) == [recovered]


def test_all_zero_residual_falls_back_to_the_target() -> None:
    # Identical distributions reject only a draft both give probability 0; the residual is then all zero.
    same = [0.5, 0.5, 0.0, 0.0]
    result = rejection([[3]], [[same, same]], [[same]], [[0.0]], [[0.7, 0.0]])
    assert result.tokens(0) == [1]
    assert result.num_accepted.tolist() == [0]


# --- exact cases with one-hot (model-free) drafts ---------------------------------------------------------


def test_one_hot_accepts_when_the_target_draws_the_draft() -> None:
    quarter, half = [0.25, 0.25, 0.5, 0.0], [0.5, 0.5, 0.0, 0.0]
    # Position 0 draws 2 (u = 0.6) = draft: accepted; position 1 draws 1 (u = 0.7) != draft 0: recovered 1.
    result = rejection([[2, 0]], [[quarter, half, half]], None, None, [[0.6, 0.7, 0.1]])
    assert result.output_token_ids.tolist() == [[2, 1, P]]
    assert result.num_accepted.tolist() == [1]
    result = rejection([[2, 1]], [[quarter, half, quarter]], None, None, [[0.6, 0.7, 0.1]])
    assert result.output_token_ids.tolist() == [[2, 1, 0]]


def test_one_hot_draft_with_zero_target_probability_is_always_rejected() -> None:
    quarter = [0.25, 0.25, 0.5, 0.0]
    for u in (0.0, 0.3, 0.999):
        result = rejection([[3]], [[quarter, quarter]], None, None, [[u, 0.0]])
        assert result.num_accepted.tolist() == [0]
        assert result.tokens(0) != [3]


def test_rows_without_drafts_sample_the_bonus_token_only() -> None:
    dist = [0.25, 0.25, 0.5, 0.0]
    for draft_probs, accept in [([[DRAFT], [DRAFT]], [[0.5], [0.5]]), (None, None)]:
        result = rejection(
            [[P], [1]], [[dist, TARGET], [TARGET, dist]], draft_probs, accept, [[0.3, 0], [0, 0.8]]
        )
        assert result.tokens(0) == [1]
        assert result.num_accepted[0] == 0
    empty = verify_rejection(
        np.zeros((1, 0), np.int64), np.zeros(1, np.int64), np.array([[dist]]), None, None, np.array([[0.55]])
    )
    assert empty.output_token_ids.tolist() == [[2]]


@pytest.mark.filterwarnings("error")
def test_padding_positions_are_never_read() -> None:
    nan = [np.nan] * 4
    dist = [0.25, 0.25, 0.5, 0.0]
    target = [[dist, dist, dist], [dist, nan, nan]]
    draft = [[dist, dist], [nan, nan]]
    for draft_probs, accept in [(draft, [[0.1, 0.1], [0.1, 0.1]]), (None, None)]:
        result = rejection([[2, 2], [P, P]], target, draft_probs, accept, [[0.6, 0.6, 0.9], [0.1, 0.5, 0.5]])
        assert result.tokens(0) == [2, 2, 2]
        assert result.output_token_ids[1].tolist() == [0, P, P]


def test_invalid_inputs_raise() -> None:
    dist = np.full((1, 2, 4), 0.25)
    drafts, lengths, uniforms = np.array([[1]]), np.array([1]), np.zeros((1, 2))
    with pytest.raises(ValueError, match="accept_uniforms"):
        verify_rejection(drafts, lengths, dist, dist[:, :1], None, uniforms)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_rejection(drafts, lengths, dist, dist, np.zeros((1, 1)), uniforms)
    with pytest.raises(ValueError, match="sample_uniforms"):
        verify_rejection(drafts, lengths, dist, None, None, uniforms[:, :1])
    with pytest.raises(ValueError, match="target_probs"):
        verify_rejection(drafts, lengths, dist[:, :1], None, None, uniforms)
    with pytest.raises(ValueError, match="draft token ids"):
        verify_rejection(np.array([[4]]), lengths, dist, None, None, uniforms)


# --- random batches against the oracle --------------------------------------------------------------------


def random_sparse_probs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Filtered-looking distributions: random, with about a third of the tokens at exactly zero."""
    probs = rng.random(shape) ** 2 * (rng.random(shape) < 0.66)
    probs[..., 0] += 1e-6
    normalized: np.ndarray = probs / probs.sum(axis=-1, keepdims=True)
    return normalized


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_random_batches_match_the_oracle(with_draft_probs: bool) -> None:
    rng = np.random.default_rng(1 + with_draft_probs)
    for _ in range(60):
        batch, max_k, vocab = int(rng.integers(1, 9)), int(rng.integers(0, 6)), int(rng.integers(2, 8))
        target_probs = random_sparse_probs(rng, (batch, max_k + 1, vocab))
        blend = rng.random((batch, max_k, 1))  # drafts from near-target to unrelated distributions
        draft_probs = blend * target_probs[:, :max_k] + (1 - blend) * random_sparse_probs(
            rng, (batch, max_k, vocab)
        )
        num_draft_tokens = rng.integers(0, max_k + 1, batch).astype(np.int64)
        proposals = sample_inverse_cdf(draft_probs.reshape(-1, vocab), rng.random(batch * max_k))
        is_draft = np.arange(max_k)[None, :] < num_draft_tokens[:, None]
        draft_token_ids = np.where(is_draft, proposals.reshape(batch, max_k), P).astype(np.int64)
        accept_uniforms, sample_uniforms = rng.random((batch, max_k)), rng.random((batch, max_k + 1))
        args = (
            draft_token_ids,
            num_draft_tokens,
            target_probs,
            draft_probs if with_draft_probs else None,
            accept_uniforms if with_draft_probs else None,
            sample_uniforms,
        )
        result = verify_rejection(*args)
        expected = verify_rejection_ref(*args)
        assert [result.tokens(b) for b in range(batch)] == expected
        assert result.num_accepted.tolist() == [len(tokens) - 1 for tokens in expected]
        padding = np.arange(max_k + 1)[None, :] > result.num_accepted[:, None]
        assert np.all(result.output_token_ids[padding] == P)


def test_one_hot_output_equals_plain_decoding_with_the_same_uniforms() -> None:
    """With position-coupled uniforms, what the drafts are (and how many) does not change the sampled text."""
    rng = np.random.default_rng(9)
    vocab, max_k = 6, 5
    chain = random_sparse_probs(rng, (vocab, vocab))  # target distribution given the previous token
    for seed in range(30):
        uniforms = PositionalUniforms(seed).take(SAMPLE_STREAM, 0, max_k + 1)
        plain, previous = [], 0
        for u in uniforms:
            previous = int(sample_inverse_cdf(chain[previous][None], np.array([u]))[0])
            plain.append(previous)
        num_drafts = int(rng.integers(0, max_k + 1))
        # Drafts that copy the plain text for a while, then guess at random.
        drafts = [plain[j] if rng.random() < 0.7 else int(rng.integers(vocab)) for j in range(num_drafts)]
        drafts += [P] * (max_k - num_drafts)
        context = [0, *[d if d != P else 0 for d in drafts]]
        target_probs = chain[np.array(context)][None]  # [1, max_k + 1, vocab]
        result = verify_rejection(
            np.array([drafts]), np.array([num_drafts]), target_probs, None, None, uniforms[None]
        )
        assert result.tokens(0) == plain[: int(result.num_emitted[0])]
