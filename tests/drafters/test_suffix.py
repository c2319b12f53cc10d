"""Suffix drafting on hand-built sequences: the walk's counts and estimates, the cache across requests, its
tenant partition and its bounds, checked against a naive oracle over explicit suffixes."""

from __future__ import annotations

import random

import pytest

from specserve.drafters.suffix import SuffixDrafter
from specserve.drafters.suffix_cache import SuffixCache
from specserve.drafters.suffix_index import MATCH_HALF, Document, Occurrence, best_walk, match_length, walk
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import FinishReason, Sequence, SequenceStatus


def make_seq(prompt: list[int], output: list[int] | None = None, rid: str = "r", salt: str = "") -> Sequence:
    seq = Sequence(rid, list(prompt), SamplingParams(), PositionalUniforms(0))
    seq.output_ids = list(output or [])
    seq.cache_salt = salt
    return seq


def finish(drafter: SuffixDrafter, seq: Sequence) -> None:
    seq.status = SequenceStatus.FINISHED
    drafter.release(seq)


def draft(drafter: SuffixDrafter, seq: Sequence, limit: int = 16) -> list[int]:
    option = drafter.available(seq, limit)
    (proposal,) = drafter.propose([seq], [option.max_tokens])
    assert len(option.token_probs) == option.max_tokens == len(proposal.token_ids)
    assert proposal.draft_probs is None  # one-hot drafts: sampling stays exact
    return proposal.token_ids


def reach(length: int) -> float:
    return length / (length + MATCH_HALF)


def test_copies_the_continuation_of_the_longest_match_in_the_prompt() -> None:
    drafter = SuffixDrafter(factor=4.0, min_prob=0.0)
    seq = make_seq([9, 1, 2, 3, 4, 5, 6, 7, 8, 20, 2, 3], [4, 5])
    drafter.begin(seq)
    # Context ends 2 3 4 5: matched at positions 2..5 (4 tokens), continuing 6 7 8 20 2 3 4 5 (the end).
    option = drafter.available(seq, 16)
    assert drafter.propose([seq], [option.max_tokens])[0].token_ids == [6, 7, 8, 20, 2, 3, 4, 5]
    assert option.bucket == "match<=4"
    assert option.token_probs == pytest.approx([reach(4 + i) for i in range(8)])


def test_frequency_splits_the_estimate_and_the_most_frequent_continuation_wins() -> None:
    drafter = SuffixDrafter(factor=4.0, min_prob=0.0)
    # 1 2 is followed by 7 twice and by 8 once; the context ends with 1 2.
    seq = make_seq([1, 2, 7, 0, 1, 2, 8, 0, 1, 2, 7, 5, 1, 2])
    drafter.begin(seq)
    option = drafter.available(seq, 1)
    assert drafter.propose([seq], [1])[0].token_ids == [7]
    assert option.token_probs[0] == pytest.approx(2 / 3 * reach(2))


def test_min_prob_stops_a_weak_chain_and_nothing_is_offered_below_it() -> None:
    seq = make_seq([1, 2, 7, 0, 1, 2, 8, 0, 1, 2, 9, 5, 1, 2])  # three continuations, one each
    weak = SuffixDrafter(min_prob=0.5)
    weak.begin(seq)
    assert weak.available(seq, 8).max_tokens == 0
    assert weak.propose([seq], [0])[0].token_ids == []


def test_factor_bounds_the_draft_by_the_match_length() -> None:
    seq = make_seq([5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 40, 1, 2])
    drafter = SuffixDrafter(factor=1.0, min_prob=0.0)
    drafter.begin(seq)
    assert draft(drafter, seq) == [3, 4]  # a 2-token match drafts at most 2 tokens at factor 1


def test_finished_outputs_are_drafted_for_the_next_request_of_the_same_tenant() -> None:
    drafter = SuffixDrafter(min_prob=0.0, factor=8.0)
    first = make_seq([100, 101, 102], [50, 51, 52, 53, 54, 55, 56], "a", salt="t1")
    drafter.begin(first)
    drafter.available(first, 4)
    finish(drafter, first)
    # The same prompt again: the first output token can be matched thanks to the prompt tail kept with it.
    again = make_seq([100, 101, 102], [], "b", salt="t1")
    drafter.begin(again)
    assert draft(drafter, again) == [50, 51, 52, 53, 54, 55, 56][: (8 * 2)]
    other = make_seq([100, 101, 102], [], "c", salt="t2")  # another tenant: nothing of t1's
    drafter.begin(other)
    assert draft(drafter, other) == []


def test_a_tenants_outputs_never_appear_in_another_tenants_drafts() -> None:
    rng = random.Random(5)
    drafter = SuffixDrafter(min_prob=0.0, factor=8.0)
    secret = [rng.randrange(1000, 2000) for _ in range(40)]
    for i in range(5):  # tenant A's outputs, each ending with its secret
        seq = make_seq([1, 2, 3, i], [7, 8, *secret], f"a{i}", salt="A")
        drafter.begin(seq)
        finish(drafter, seq)
    live = make_seq([1, 2, 3, 9], [7, 8, *secret[:10]], "a-live", salt="A")
    drafter.begin(live)  # tenant A's running request too
    drafter.available(live, 8)
    for start in range(0, 30, 3):  # tenant B's contexts quote every part of A's secret
        probe = make_seq([4, 5, 6], [7, 8, *secret[start : start + 3]], f"b{start}", salt="B")
        drafter.begin(probe)
        assert not set(draft(drafter, probe)) & set(secret)
        drafter.release(probe)
        same = make_seq([4, 5, 6], [7, 8, *secret[start : start + 3]], f"a{start}", salt="A")
        drafter.begin(same)
        assert draft(drafter, same)[:3] == secret[start + 3 : start + 6]  # the partition is what stops B
        drafter.release(same)


def test_a_running_request_drafts_from_another_running_request_of_its_tenant() -> None:
    drafter = SuffixDrafter(min_prob=0.0, factor=8.0)
    leader = make_seq([1, 2, 3], [10, 11, 12, 13, 14, 15], "lead")
    follower = make_seq([1, 2, 3], [10, 11], "follow")
    for seq in (leader, follower):
        drafter.begin(seq)
        drafter.available(seq, 8)
    assert draft(drafter, follower)[:4] == [12, 13, 14, 15]
    drafter.release(leader)  # released without finishing (an abort-free reset): not remembered
    assert drafter.cache.num_requests == 0


def test_a_copy_side_by_side_with_a_request_a_token_ahead_keeps_its_estimate() -> None:
    """Two requests copy a finished output at once, one a token ahead (the engine admitted it a step
    earlier). The leader's document ends because it is still being written, which says nothing against the
    copy: the follower's estimate is the one it would have alone (counted against, its second token was
    rated 0.49 and two repeated tasks at concurrency 4 drafted one token a step)."""
    source = [50 + i for i in range(40)]

    def follower_estimate(with_leader: bool) -> tuple[list[int], tuple[float, ...]]:
        drafter = SuffixDrafter(min_prob=0.0, factor=8.0)
        first = make_seq([100, 101, 102], source, "first")
        first.finish_reason = "stop"
        drafter.begin(first)
        finish(drafter, first)
        follower = make_seq([100, 101, 102], source[:10], "follow")
        drafter.begin(follower)
        if with_leader:
            leader = make_seq([100, 101, 102], source[:11], "lead")
            drafter.begin(leader)
            drafter.available(leader, 8)  # now visible to its tenant
        option = drafter.available(follower, 16)
        return drafter.propose([follower], [option.max_tokens])[0].token_ids, option.token_probs

    alone, together = follower_estimate(False), follower_estimate(True)
    assert alone[0] == together[0] == source[10:26]
    assert together[1] == pytest.approx(alone[1])


@pytest.mark.parametrize(("reason", "ends"), [("stop", True), ("length", False), ("abort", False)])
def test_only_an_output_that_stopped_counts_its_end_against_a_copy(reason: FinishReason, ends: bool) -> None:
    """An output cut at its length limit (or aborted) could have gone on: its end is no evidence."""
    drafter = SuffixDrafter(min_prob=0.0, factor=8.0)
    for rid, output in (("long", [7, 8, 9, 10, 11, 12]), ("short", [7, 8, 9])):
        seq = make_seq([1, 2, 3], output, rid)
        seq.finish_reason = reason if rid == "short" else "stop"
        drafter.begin(seq)
        finish(drafter, seq)
    probe = make_seq([4, 5, 6], [7, 8], "probe")
    drafter.begin(probe)
    option = drafter.available(probe, 3)
    # Both outputs continue 7 8 with 9; then only "long" goes on, with 10.
    assert drafter.propose([probe], [2])[0].token_ids == [9, 10]
    share = 1 / 2 if ends else 1.0
    assert option.token_probs[:2] == pytest.approx([reach(2), share * reach(3)])


def test_the_cache_stays_within_its_bounds_under_a_long_run() -> None:
    rng = random.Random(0)
    drafter = SuffixDrafter(cache_requests=20, cache_tokens=600, depth=8)
    for i in range(500):
        salt = f"t{i % 3}"
        output = [rng.randrange(50) for _ in range(rng.randrange(1, 90))]
        seq = make_seq([rng.randrange(50) for _ in range(30)], output, f"r{i}", salt=salt)
        drafter.begin(seq)
        for _ in range(3):
            drafter.available(seq, 8)
        finish(drafter, seq)
        cache = drafter.cache
        assert cache.num_requests <= 20 and cache.num_tokens <= 600
        held = sum(len(d.tokens) for t in ("t0", "t1", "t2") for d in cache.documents(t, ""))
        assert cache.num_tokens == held
    assert not drafter.cache._live  # every request's document was dropped


def test_an_output_longer_than_the_cache_keeps_its_tail() -> None:
    cache = SuffixCache(max_requests=4, max_tokens=10, key_len=2, context_tokens=4)
    cache.add_finished("", [1, 2, 3], list(range(100, 125)))
    (doc,) = cache.documents("", "")
    assert doc.tokens == list(range(115, 125)) and cache.num_tokens == 10


def naive_walk(corpus: list[list[int]], context: list[int], length: int, max_tokens: int) -> list[int]:
    """The suffix-tree walk done by brute force: every position whose preceding ``length`` tokens equal the
    context's last ``length``, then the most frequent next token among those agreeing so far."""
    suffix = context[-length:]
    starts = [
        (doc, p) for doc in corpus for p in range(length, len(doc) + 1) if doc[p - length : p] == suffix
    ]
    out: list[int] = []
    for depth in range(max_tokens):
        nexts = [doc[p + depth] for doc, p in starts if p + depth < len(doc)]
        if not nexts:
            break
        counts = {t: nexts.count(t) for t in set(nexts)}
        best = max(counts, key=lambda t: counts[t])
        if list(counts.values()).count(counts[best]) > 1:
            break  # a tie: the walk takes the latest occurrence's token, the brute force has no order
        out.append(best)
        starts = [(doc, p) for doc, p in starts if p + depth < len(doc) and doc[p + depth] == best]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_walk_equals_a_brute_force_suffix_walk(seed: int) -> None:
    rng = random.Random(seed)
    corpus = [[rng.randrange(4) for _ in range(rng.randrange(5, 60))] for _ in range(3)]
    context = [rng.randrange(4) for _ in range(12)]
    docs = []
    for tokens in corpus:
        doc = Document(2)
        doc.extend(tokens)
        docs.append(doc)
    for length in (2, 3, 5):
        occurrences = [
            Occurrence(doc, p, m)
            for doc in docs
            for p in doc.occurrences(tuple(context[-2:]), 10_000, start=0)
            if (m := match_length(context, doc, p, 64)) >= length
        ]
        got = walk(occurrences, length, 12, 0.0)
        expected = naive_walk(corpus, context, length, 12)
        # A tie between two continuations is resolved by recency in the walk; compare up to the first tie.
        assert list(got.token_ids[: len(expected)]) == expected


def test_best_walk_prefers_the_higher_expected_acceptance() -> None:
    doc = Document(2)
    doc.extend([3, 1, 2, 5, 6, 7, 8, 9, 0, 4, 1, 2, 9, 9, 9, 9])
    context = [4, 1, 2]  # the 3-token match continues 9 9 9 9; the 2-token one splits 5 / 9
    positions = doc.occurrences((1, 2), 9, 0)
    occurrences = [Occurrence(doc, p, match_length(context, doc, p, 32)) for p in positions]
    assert best_walk(occurrences, 8, 2.0, 0.0).token_ids[:2] == (9, 9)
