"""Prompt-lookup drafting on hand-built sequences: which occurrence wins, what is proposed, buckets."""

from __future__ import annotations

import random

import pytest

from specserve.drafters.base import DraftOption
from specserve.drafters.ngram import NgramDrafter, match_bucket
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import Sequence


def make_seq(prompt_ids: list[int], output_ids: list[int] | None = None) -> Sequence:
    seq = Sequence("r", list(prompt_ids), SamplingParams(), PositionalUniforms(0))
    seq.output_ids = list(output_ids or [])
    return seq


def draft(drafter: NgramDrafter, seq: Sequence, limit: int) -> tuple[DraftOption, list[int]]:
    """What the engine does per step: ask for the option, then propose its maximum."""
    option = drafter.available(seq, limit)
    (proposal,) = drafter.propose([seq], [option.max_tokens])
    assert proposal.draft_probs is None
    assert len(proposal.token_ids) == option.max_tokens
    return option, proposal.token_ids


@pytest.mark.parametrize(
    ("match_len", "bucket"),
    [(1, "match<=2"), (2, "match<=2"), (3, "match<=4"), (4, "match<=4"), (5, "match<=8"), (8, "match<=8"),
     (9, "match<=16"), (16, "match<=16"), (17, "match>16"), (64, "match>16")],
)  # fmt: skip
def test_match_bucket(match_len: int, bucket: str) -> None:
    assert match_bucket(match_len) == bucket


def test_no_match_offers_nothing() -> None:
    drafter = NgramDrafter()
    seq = make_seq([1, 2, 3, 4, 5, 6])
    assert drafter.available(seq, 8) == DraftOption(0)
    assert drafter.propose([seq], [0])[0].token_ids == []


def test_too_short_history_offers_nothing() -> None:
    drafter = NgramDrafter(min_n=2)
    assert drafter.available(make_seq([1, 2]), 8) == DraftOption(0)
    assert drafter.available(make_seq([1]), 8) == DraftOption(0)


def test_the_current_suffix_itself_is_not_a_match() -> None:
    # (3, 4) occurs only at the very end: it has no continuation yet.
    assert NgramDrafter().available(make_seq([1, 2, 3, 4]), 8).max_tokens == 0


def test_limit_zero_offers_nothing() -> None:
    drafter = NgramDrafter()
    seq = make_seq([1, 2, 3, 1, 2])
    assert drafter.available(seq, 0) == DraftOption(0)
    assert drafter.propose([seq], [0])[0].token_ids == []


def test_latest_occurrence_wins_a_tie() -> None:
    # (1, 2) occurs twice before the end, both times a 2-token match (preceded by 7 and 8, the end by 9).
    seq = make_seq([7, 1, 2, 10, 8, 1, 2, 20, 9, 1, 2])
    option, tokens = draft(NgramDrafter(), seq, 3)
    assert option == DraftOption(3, "match<=2")
    assert tokens == [20, 9, 1]


def test_longest_occurrence_wins_over_a_later_one() -> None:
    # The first (1, 2) extends backwards to a 4-token match (5, 6, 1, 2); the later one only to 2 tokens.
    seq = make_seq([5, 6, 1, 2, 30, 31, 9, 1, 2, 40, 5, 6, 1, 2])
    option, tokens = draft(NgramDrafter(), seq, 2)
    assert option == DraftOption(2, "match<=4")
    assert tokens == [30, 31]


def test_proposal_is_truncated_to_the_available_history() -> None:
    # The match continues with 3, 1, 2 and then reaches the end of the history.
    drafter = NgramDrafter()
    seq = make_seq([1, 2, 3, 1, 2])
    option, tokens = draft(drafter, seq, 10)
    assert option.max_tokens == 3
    assert tokens == [3, 1, 2]
    # Asking propose for more than was offered still yields only what exists.
    assert drafter.propose([seq], [10])[0].token_ids == [3, 1, 2]


def test_proposal_is_truncated_to_the_asked_number() -> None:
    drafter = NgramDrafter()
    seq = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 1, 2])
    assert drafter.available(seq, 8).max_tokens == 8
    for k in (1, 3, 8):
        assert drafter.propose([seq], [k])[0].token_ids == [3, 4, 5, 6, 7, 8, 1, 2][:k]


@pytest.mark.parametrize(
    ("match_len", "bucket"),
    [(2, "match<=2"), (3, "match<=4"), (8, "match<=8"), (9, "match<=16"), (40, "match>16")],
)
def test_bucket_reflects_match_length(match_len: int, bucket: str) -> None:
    repeated = list(range(100, 100 + match_len))
    # The copies are preceded by different tokens (1 vs 2), so the match is exactly match_len long.
    seq = make_seq([1, *repeated, 50, 51, 2, *repeated])
    option, tokens = draft(NgramDrafter(), seq, 2)
    assert option.bucket == bucket
    assert tokens == [50, 51]


def test_max_match_caps_the_measured_length() -> None:
    repeated = list(range(100, 140))
    seq = make_seq([1, *repeated, 50, 2, *repeated])
    assert NgramDrafter(max_match=8).available(seq, 4).bucket == "match<=8"


def test_longer_min_n_needs_a_longer_suffix() -> None:
    seq = make_seq([1, 2, 3, 9, 2, 3])  # (2, 3) repeats; (9, 2, 3) does not
    assert NgramDrafter(min_n=2).available(seq, 4).max_tokens > 0
    assert NgramDrafter(min_n=3).available(seq, 4).max_tokens == 0
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(min_n=0)


def test_index_updates_incrementally_as_output_grows() -> None:
    drafter = NgramDrafter()
    seq = make_seq([1, 2, 3, 4])
    drafter.begin(seq)
    assert drafter.available(seq, 8).max_tokens == 0

    seq.output_ids.extend([1, 2])  # tokens: 1 2 3 4 1 2 -> (1, 2) continues with 3
    option, tokens = draft(drafter, seq, 8)
    assert option == DraftOption(4, "match<=2")
    assert tokens == [3, 4, 1, 2]

    seq.output_ids.append(3)  # tokens: 1 2 3 4 1 2 3 -> (2, 3) matches 1 2 3, continues with 4
    option, tokens = draft(drafter, seq, 2)
    assert option == DraftOption(2, "match<=4")
    assert tokens == [4, 1]

    seq.output_ids.append(77)  # a new token no earlier n-gram continues
    assert drafter.available(seq, 8).max_tokens == 0
    seq.output_ids.extend([1, 2])  # (1, 2) now occurs twice earlier: the latest continues with 3 -> 77
    option, tokens = draft(drafter, seq, 8)
    assert tokens[:2] == [3, 77]

    # Each n-gram position is indexed once, however often available() is called.
    for _ in range(3):
        drafter.available(seq, 8)
    index = seq.drafter_state["ngram"]
    assert index.positions[(1, 2)] == [2, 6]  # type: ignore[attr-defined]
    assert index.indexed == seq.num_tokens  # type: ignore[attr-defined]


def test_a_failed_lookup_clears_the_previous_match() -> None:
    drafter = NgramDrafter()
    seq = make_seq([1, 2, 3, 1, 2])
    assert drafter.available(seq, 4).max_tokens > 0
    seq.output_ids.append(99)
    assert drafter.available(seq, 4).max_tokens == 0
    assert drafter.propose([seq], [4])[0].token_ids == []


def test_propose_for_a_batch() -> None:
    drafter = NgramDrafter()
    seqs = [make_seq([1, 2, 3, 1, 2]), make_seq([5, 6, 7]), make_seq([4, 5, 8, 9, 4, 5])]
    asked = [drafter.available(s, 2).max_tokens for s in seqs]
    assert asked == [2, 0, 2]
    assert [p.token_ids for p in drafter.propose(seqs, asked)] == [[3, 1], [], [8, 9]]


def test_begin_resets_and_release_frees_state() -> None:
    drafter = NgramDrafter()
    seq = make_seq([1, 2, 3, 1, 2])
    drafter.available(seq, 4)
    drafter.begin(seq)
    assert seq.drafter_state["ngram"].indexed == 0  # type: ignore[attr-defined]
    drafter.release(seq)
    assert "ngram" not in seq.drafter_state


def _match_length_one_at_a_time(drafter: NgramDrafter, tokens: list[int], start: int) -> int:
    """The definition: extend the index's n-gram backwards a token at a time."""
    length, end = drafter.min_n, len(tokens)
    while length < drafter.max_match and start - length - 1 >= 0:
        if tokens[start - length - 1] != tokens[end - length - 1]:
            break
        length += 1
    return length


@pytest.mark.parametrize("seed", range(4))
def test_the_match_length_compared_a_slice_at_a_time_is_the_definitions(seed: int) -> None:
    rng = random.Random(seed)
    drafter = NgramDrafter(min_n=rng.choice([1, 2, 3]), max_match=rng.choice([5, 16, 40, 64]))
    for _ in range(300):
        period = rng.randrange(1, 30)
        base = [rng.randrange(4) for _ in range(period)]
        tokens = (base * 10)[: rng.randrange(2, 200)]
        if rng.random() < 0.5:  # break the repetition somewhere
            tokens[rng.randrange(len(tokens))] = 9
        for start in range(len(tokens) + 1):
            expected = _match_length_one_at_a_time(drafter, tokens, start)
            assert drafter._match_length(tokens, start) == expected, (tokens, start)
