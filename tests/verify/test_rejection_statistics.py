"""Rejection sampling is lossless: the emitted tokens follow the target distribution, whatever the drafts.

A small Markov-chain "language" (10 tokens; 12 in the slow run) stands in for the models: the target's and the
drafter's next-token distributions depend on the previous token, and the same temperature, top-k and top-p
filters shape both. Many trials run as one batch; the first emitted token and the pair of the first two are
compared with the exact target probabilities (chi-square and total variation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from scipy.stats import chisquare

from specserve.verify import (
    PLACEHOLDER_TOKEN_ID,
    VerifyResult,
    filter_logits_to_probs,
    sample_inverse_cdf,
    verify_rejection,
)

P = PLACEHOLDER_TOKEN_ID


@dataclass(frozen=True)
class Setup:
    """A Markov-chain 'language': the distribution of the next token depends on the previous one."""

    target_chain: np.ndarray  # [vocab, vocab] float64: target_chain[prev] is the target's next-token dist
    draft_chain: np.ndarray | None  # [vocab, vocab] float64, or None: one-hot drafts
    proposal_chain: np.ndarray  # [vocab, vocab] float64: where one-hot drafts come from
    max_k: int

    @property
    def vocab(self) -> int:
        return int(self.target_chain.shape[0])


CONTEXT_TOKEN = 0


@dataclass(frozen=True)
class Filters:
    temperature: float
    top_k: int
    top_p: float
    min_p: float = 0.0


def make_setup(seed: int, vocab: int, max_k: int, mode: str, filters: Filters) -> Setup:
    """Target and draft differ; temperature, top-k, top-p and min-p are applied identically to both."""
    rng = np.random.default_rng(seed)
    target_logits = (rng.standard_normal((vocab, vocab)) * 1.2).astype(np.float32)
    draft_logits = target_logits + 0.8 * rng.standard_normal((vocab, vocab)).astype(np.float32)
    settings = (filters.temperature, filters.top_k, filters.top_p, filters.min_p)
    target_chain = filter_logits_to_probs(target_logits, *settings)
    draft_chain = filter_logits_to_probs(draft_logits, *settings)
    chains = {"draft_model": draft_chain, "self_draft": target_chain, "one_hot": None}
    return Setup(target_chain, chains[mode], draft_chain, max_k)


@dataclass(frozen=True)
class Step:
    result: VerifyResult
    num_draft_tokens: np.ndarray  # [n] int64


def speculative_step(setup: Setup, context: np.ndarray, rng: np.random.Generator) -> Step:
    """Draft up to max_k tokens after each row's context token (ragged lengths) and verify them."""
    n, max_k = context.size, setup.max_k
    prefix = np.empty((n, max_k + 1), dtype=np.int64)  # prefix[:, j]: the token before output position j
    prefix[:, 0] = context
    for j in range(max_k):
        previous = prefix[:, j]
        if setup.draft_chain is not None:
            prefix[:, j + 1] = sample_inverse_cdf(setup.draft_chain[previous], rng.random(n))
        else:  # a model-free drafter: half the time its best guess, otherwise any token at all
            guess = setup.proposal_chain[previous].argmax(axis=1)
            prefix[:, j + 1] = np.where(rng.random(n) < 0.5, guess, rng.integers(0, setup.vocab, n))
    num_draft_tokens = rng.integers(0, max_k + 1, n).astype(np.int64)
    is_draft = np.arange(max_k)[None, :] < num_draft_tokens[:, None]
    draft_token_ids = np.where(is_draft, prefix[:, 1:], P).astype(np.int64)
    draft_probs = None if setup.draft_chain is None else setup.draft_chain[prefix[:, :max_k]]
    result = verify_rejection(
        draft_token_ids,
        num_draft_tokens,
        setup.target_chain[prefix],
        draft_probs,
        rng.random((n, max_k)),
        rng.random((n, max_k + 1)),
    )
    return Step(result, num_draft_tokens)


def assert_follows(samples: np.ndarray, expected: np.ndarray, max_tv: float) -> None:
    """Chi-square (cells with expected count < 5 pooled) and total variation against exact probabilities."""
    counts = np.bincount(samples, minlength=expected.size)
    assert counts[expected == 0].sum() == 0, "a token the target forbids was emitted"
    tv = 0.5 * np.abs(counts / samples.size - expected).sum()
    assert tv < max_tv, f"total variation {tv:.4f}"
    observed, expected_counts = counts[expected > 0], expected[expected > 0] * samples.size
    small = expected_counts < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected_counts = np.append(expected_counts[~small], expected_counts[small].sum())
    expected_counts *= observed.sum() / expected_counts.sum()
    p_value = chisquare(observed, expected_counts).pvalue
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e} (tv {tv:.4f})"


def check_lossless(setup: Setup, trials: int, seed: int, max_tv: float) -> Step:
    """The first token, and the pair of the first two tokens, follow the target chain exactly.

    Rows that emitted a single token take one more speculative step from it for their second token.
    """
    rng = np.random.default_rng(seed)
    step = speculative_step(setup, np.full(trials, CONTEXT_TOKEN, dtype=np.int64), rng)
    first = step.result.output_token_ids[:, 0]
    second = step.result.output_token_ids[:, 1].copy()
    one_token = step.result.num_accepted == 0
    second[one_token] = speculative_step(setup, first[one_token], rng).result.output_token_ids[:, 0]

    target = setup.target_chain
    assert_follows(first, target[CONTEXT_TOKEN], max_tv)
    pair_probs = target[CONTEXT_TOKEN][:, None] * target  # P(first = a, second = b)
    assert_follows(first * setup.vocab + second, pair_probs.ravel(), max_tv)
    return step


FILTERS = Filters(temperature=0.8, top_k=7, top_p=0.9)


@pytest.mark.parametrize("mode", ["draft_model", "one_hot", "self_draft"])
def test_output_follows_the_target_distribution(mode: str) -> None:
    setup = make_setup(seed=2023, vocab=10, max_k=4, mode=mode, filters=FILTERS)
    step = check_lossless(setup, trials=80_000, seed=17, max_tv=0.02)
    num_accepted, num_draft_tokens = step.result.num_accepted, step.num_draft_tokens
    if mode == "self_draft":  # draft_probs == target_probs: u * q < q always holds
        assert num_accepted.sum() >= 0.98 * num_draft_tokens.sum()
    if mode == "draft_model":  # first-position acceptance rate = sum_x min(target(x), draft(x))
        assert setup.draft_chain is not None
        rate = np.minimum(setup.target_chain[CONTEXT_TOKEN], setup.draft_chain[CONTEXT_TOKEN]).sum()
        assert 0.3 < rate < 0.95, "the setup should produce both acceptances and rejections"
        drafted = num_draft_tokens > 0
        observed = (num_accepted[drafted] > 0).mean()
        assert abs(observed - rate) < 4 * np.sqrt(rate * (1 - rate) / drafted.sum())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["draft_model", "one_hot", "self_draft"])
def test_output_follows_the_target_distribution_long(mode: str) -> None:
    filters = Filters(temperature=1.1, top_k=10, top_p=0.95, min_p=0.02)
    setup = make_setup(seed=7, vocab=12, max_k=6, mode=mode, filters=filters)
    check_lossless(setup, trials=600_000, seed=99, max_tv=0.006)
