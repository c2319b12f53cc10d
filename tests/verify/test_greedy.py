"""Greedy verification: exact hand-built cases, then random batches against the naive oracle."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.request import SamplingParams
from specserve.verify import PLACEHOLDER_TOKEN_ID, VerifyRequest, VerifyResult, verify_greedy
from specserve.verify.greedy import accept_greedy_choices, verify_greedy_choices

from .reference import verify_greedy_ref

P = PLACEHOLDER_TOKEN_ID
VOCAB = 10


def logits_choosing(choices: list[list[int]], vocab: int = VOCAB) -> np.ndarray:
    """[batch, positions, vocab] float32 logits whose argmax at [b, j] is choices[b][j] (-1: NaN padding)."""
    rng = np.random.default_rng(0)
    logits = rng.uniform(-1.0, 1.0, (len(choices), len(choices[0]), vocab)).astype(np.float32)
    for b, row in enumerate(choices):
        for j, choice in enumerate(row):
            if choice < 0:
                logits[b, j] = np.nan  # padding: must never be looked at
            else:
                logits[b, j, choice] = 5.0
    return logits


def run(drafts: list[list[int]], choices: list[list[int]]) -> VerifyResult:
    draft_token_ids = np.array(drafts, dtype=np.int64)
    num_draft_tokens = (draft_token_ids != P).sum(axis=1).astype(np.int64)
    return verify_greedy(draft_token_ids, num_draft_tokens, logits_choosing(choices))


def test_all_drafts_accepted_then_the_bonus_token() -> None:
    result = run([[4, 7, 2]], [[4, 7, 2, 9]])
    assert result.output_token_ids.tolist() == [[4, 7, 2, 9]]
    assert result.num_accepted.tolist() == [3]
    assert result.tokens(0) == [4, 7, 2, 9]


def test_first_draft_rejected_emits_the_recovered_token() -> None:
    result = run([[4, 7, 2]], [[5, 7, 2, 9]])
    assert result.output_token_ids.tolist() == [[5, P, P, P]]
    assert result.num_accepted.tolist() == [0]


def test_middle_draft_rejected() -> None:
    result = run([[4, 7, 2]], [[4, 7, 5, 9]])
    assert result.output_token_ids.tolist() == [[4, 7, 5, P]]
    assert result.num_accepted.tolist() == [2]
    assert result.tokens(0) == [4, 7, 5]


def test_no_drafts_is_a_plain_greedy_step() -> None:
    result = run([[P, P]], [[6, -1, -1]])
    assert result.output_token_ids.tolist() == [[6, P, P]]
    assert result.num_accepted.tolist() == [0]
    empty = verify_greedy(np.zeros((2, 0), np.int64), np.zeros(2, np.int64), logits_choosing([[3], [8]]))
    assert empty.output_token_ids.tolist() == [[3], [8]]


def test_ragged_batch_ignores_padding() -> None:
    # Padded positions hold NaN logits; a match against the padding would be a bug.
    drafts = [[1, 2, 3], [1, P, P], [P, P, P], [5, 6, P], [7, 8, P]]
    choices = [
        [1, 2, 4, 0],
        [1, 9, -1, -1],
        [3, -1, -1, -1],
        [5, 6, 0, -1],
        [2, 8, 1, -1],
    ]
    result = run(drafts, choices)
    assert result.output_token_ids.tolist() == [
        [1, 2, 4, P],
        [1, 9, P, P],
        [3, P, P, P],
        [5, 6, 0, P],
        [2, P, P, P],
    ]
    assert result.num_accepted.tolist() == [2, 1, 0, 2, 0]
    assert result.num_emitted.tolist() == [3, 2, 1, 3, 1]


def test_ties_in_the_target_logits_pick_the_lowest_id() -> None:
    logits = np.zeros((1, 2, 4), dtype=np.float32)
    logits[0, 0, [1, 2]] = 1.0  # argmax 1, not 2
    logits[0, 1, [0, 3]] = 2.0
    result = verify_greedy(np.array([[2]]), np.array([1]), logits)
    assert result.tokens(0) == [1]
    result = verify_greedy(np.array([[1]]), np.array([1]), logits)
    assert result.tokens(0) == [1, 0]


def test_invalid_inputs_raise() -> None:
    logits = np.zeros((1, 3, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        verify_greedy(np.array([[1, 2]]), np.array([3]), logits)
    with pytest.raises(ValueError, match="draft token ids"):
        verify_greedy(np.array([[1, 4]]), np.array([2]), logits)
    with pytest.raises(ValueError, match="draft token ids"):
        verify_greedy(np.array([[1, P]]), np.array([2]), logits)
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(np.array([[1, 2]]), np.array([2]), logits[:, :2])


def test_result_is_immutable() -> None:
    result = run([[4]], [[4, 1]])
    with pytest.raises(AttributeError):
        result.num_accepted = np.array([0])  # type: ignore[misc]


@pytest.mark.parametrize("vocab", [3, 50])
def test_random_batches_match_the_oracle(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    for _ in range(40):
        batch, max_k = int(rng.integers(1, 9)), int(rng.integers(0, 7))
        logits = rng.standard_normal((batch, max_k + 1, vocab)).astype(np.float32)
        logits = (np.round(logits * 2) / 2).astype(np.float32)  # exact ties in the target
        num_draft_tokens = rng.integers(0, max_k + 1, batch).astype(np.int64)
        target_choice = logits.argmax(axis=-1)
        # Mostly copy the target's choice so that long accepted runs occur; sometimes a random token.
        guesses = np.where(rng.random((batch, max_k)) < 0.8, target_choice[:, :max_k], 0)
        guesses = np.where(rng.random((batch, max_k)) < 0.1, rng.integers(0, vocab, (batch, max_k)), guesses)
        is_draft = np.arange(max_k)[None, :] < num_draft_tokens[:, None]
        draft_token_ids = np.where(is_draft, guesses, P).astype(np.int64)

        result = verify_greedy(draft_token_ids, num_draft_tokens, logits)
        expected = verify_greedy_ref(draft_token_ids, num_draft_tokens, logits)
        assert [result.tokens(b) for b in range(batch)] == expected
        assert result.num_accepted.tolist() == [len(tokens) - 1 for tokens in expected]
        padding = np.arange(max_k + 1)[None, :] > result.num_accepted[:, None]
        assert np.all(result.output_token_ids[padding] == P)
        assert result.output_token_ids.dtype == np.int64 and result.num_accepted.dtype == np.int64


@pytest.mark.parametrize("seed", range(3))
def test_accepting_from_row_choices_gives_the_padded_batchs_tokens(seed: int) -> None:
    """The host-integer path a greedy step takes after its one argmax equals the padded-array verifier."""
    rng = np.random.default_rng(seed)
    vocab = 6  # small: drafts often equal the choices, so long accepted runs occur
    for _ in range(200):
        ks = rng.integers(0, 6, size=rng.integers(1, 6))
        requests = [
            VerifyRequest([int(t) for t in rng.integers(0, vocab, size=k)], SamplingParams()) for k in ks
        ]
        choices = rng.integers(0, vocab, size=int(ks.sum() + len(ks)))
        for r, lo in zip(requests, np.cumsum([0, *(ks + 1)])[:-1], strict=False):  # often agree with drafts
            for j, t in enumerate(r.draft_ids):
                if rng.random() < 0.7:
                    choices[lo + j] = t
        max_k = int(ks.max())
        drafts = np.full((len(ks), max_k), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        padded = np.full((len(ks), max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        lo = 0
        for b, (r, k) in enumerate(zip(requests, ks, strict=True)):
            drafts[b, :k] = r.draft_ids
            padded[b, : k + 1] = choices[lo : lo + k + 1]
            lo += k + 1
        expected = verify_greedy_choices(drafts, ks.astype(np.int64), padded, vocab)
        got = accept_greedy_choices(choices.tolist(), requests, vocab)
        assert got == [expected.tokens(b) for b in range(len(ks))]


def test_accepting_from_row_choices_rejects_what_the_batch_verifier_rejects() -> None:
    with pytest.raises(ValueError, match="3 rows, the requests 4"):
        accept_greedy_choices([1, 2, 3], [VerifyRequest([1, 2, 3], SamplingParams())], 12)
    with pytest.raises(ValueError, match="draft token ids"):
        accept_greedy_choices([1, 2, 3], [VerifyRequest([1, 12], SamplingParams())], 12)
