"""Draft length policies: the cost-aware choice on GPU-like and CPU-like cost tables; learning; fixed."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

import pytest

from specserve.backends.base import one_call
from specserve.backends.llama_cpp_passes import stream_passes
from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.suffix import SuffixDrafter
from specserve.engine.cost_model import CostModel, StepCostTable
from specserve.engine.cost_policy import CostAwarePolicy
from specserve.engine.draft_policy import (
    MAX_ACCEPTANCE,
    PRIOR_ACCEPTANCE,
    DraftPlan,
    FixedLengthPolicy,
    expected_tokens,
)
from specserve.engine.speculation_budget import SpeculationBudget
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import Sequence

Options = dict[str, tuple[Drafter, DraftOption]]

STEP = 0.010  # seconds of a one-token target step


def gpu_like() -> StepCostTable:
    """Verification is almost free up to 16 tokens, then grows."""
    return StepCostTable.from_samples({1: STEP, 16: STEP * 1.05, 32: STEP * 2, 64: STEP * 4})


def cpu_like() -> StepCostTable:
    """Every token costs as much as the first: cost(n) = n * cost(1)."""
    return StepCostTable.from_samples({1: STEP, 64: 64 * STEP})


class StubDrafter(Drafter):
    """Offers a fixed option; proposes zeros (the policy never looks at tokens)."""

    name = "stub"

    def __init__(self, option: DraftOption) -> None:
        self.option = option

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        return self.option

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        return [Proposal([0] * k) for k in num_tokens]


class OtherStub(StubDrafter):
    name = "other"


class ModelStub(StubDrafter):
    name = "model-stub"
    uses_model = True


def make_seq(request_id: str = "r") -> Sequence:
    return Sequence(request_id, [1, 2, 3], SamplingParams(), PositionalUniforms(0))


def ngram_option(max_tokens: int = 16, bucket: str = "match>16") -> Options:
    return {"ngram": (NgramDrafter(), DraftOption(max_tokens, bucket))}


def assert_valid(plans: list[DraftPlan], options: Seq[Mapping[str, tuple[Drafter, DraftOption]]]) -> None:
    assert len(plans) == len(options)
    for plan, opts in zip(plans, options, strict=True):
        if plan.drafter is None:
            assert plan.num_tokens == 0
            continue
        offered = {drafter.name: option for drafter, option in opts.values()}
        assert plan.drafter.name in offered
        option = offered[plan.drafter.name]
        assert 1 <= plan.num_tokens <= option.max_tokens
        assert plan.bucket == option.bucket
        assert plan.setup_tokens == option.setup_tokens
        assert 0.0 <= plan.alpha <= 1.0


# -- expected tokens --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("alpha", "k", "expected"),
    [(0.5, 2, 1.75), (0.5, 0, 1.0), (0.5, 1, 1.5), (0.0, 5, 1.0), (1.0, 4, 5.0), (0.9, 2, 2.71)],
)
def test_expected_tokens(alpha: float, k: int, expected: float) -> None:
    assert expected_tokens(alpha, k) == pytest.approx(expected)


# -- cost-aware choice ------------------------------------------------------------------------------


def test_gpu_like_costs_draft_long_for_a_long_match() -> None:
    policy = CostAwarePolicy(CostModel(gpu_like()))
    options = [ngram_option(16, "match>16")]
    (plan,) = policy.plan([make_seq()], options)
    assert_valid([plan], options)
    assert isinstance(plan.drafter, NgramDrafter)
    assert plan.num_tokens >= 10  # verifying ~15 tokens costs about one step
    assert plan.bucket == "match>16"
    assert plan.alpha == pytest.approx(PRIOR_ACCEPTANCE["match>16"])


@pytest.mark.parametrize("bucket", ["match<=2", "match>16"])
def test_cpu_like_costs_choose_plain_decoding(bucket: str) -> None:
    # With cost(n) = n * cost(1), k drafts cost k + 1 steps and yield at most k + 1 tokens: never a win.
    policy = CostAwarePolicy(CostModel(cpu_like()))
    (plan,) = policy.plan([make_seq()], [ngram_option(16, bucket)])
    assert plan == DraftPlan()
    assert plan.drafter is None


def test_nothing_offered_means_plain_decoding() -> None:
    policy = CostAwarePolicy(CostModel(gpu_like()))
    options: list[Options] = [{}, ngram_option(0, "")]
    assert policy.plan([make_seq("a"), make_seq("b")], options) == [DraftPlan(), DraftPlan()]


def test_full_acceptance_raises_alpha_and_the_draft_length() -> None:
    policy = CostAwarePolicy(CostModel(gpu_like()))
    seq = make_seq()
    drafter = NgramDrafter()
    before = policy.acceptance.alpha(seq, "ngram", "match<=2")
    (plan_before,) = policy.plan([seq], [ngram_option(16, "match<=2")])
    for _ in range(30):
        policy.observe(seq, DraftPlan(drafter, 8, "match<=2", before), 8)
    after = policy.acceptance.alpha(seq, "ngram", "match<=2")
    assert after > before
    assert after > 0.95
    (plan_after,) = policy.plan([seq], [ngram_option(16, "match<=2")])
    assert isinstance(plan_after.drafter, NgramDrafter)
    assert plan_after.num_tokens > plan_before.num_tokens
    assert plan_after.alpha == pytest.approx(after)


def test_rejections_lower_alpha_and_turn_speculation_off() -> None:
    policy = CostAwarePolicy(CostModel(gpu_like()))
    seq = make_seq()
    options = [ngram_option(16, "match<=8")]
    (first,) = policy.plan([seq], options)
    assert first.drafter is not None  # the prior (0.65) makes cheap verification worth it
    before = policy.acceptance.alpha(seq, "ngram", "match<=8")
    for _ in range(30):
        policy.observe(seq, DraftPlan(first.drafter, 4, "match<=8", before), 0)
    after = policy.acceptance.alpha(seq, "ngram", "match<=8")
    assert after < before / 4
    (plan,) = policy.plan([seq], options)
    assert plan.drafter is None


def test_acceptance_learned_on_one_request_is_a_prior_for_the_next() -> None:
    policy = CostAwarePolicy(CostModel(gpu_like()))
    first, second = make_seq("a"), make_seq("b")
    prior = policy.acceptance.alpha(second, "ngram", "match<=4")
    for _ in range(20):
        policy.observe(first, DraftPlan(NgramDrafter(), 4, "match<=4", prior), 4)
    shared = policy.acceptance.alpha(second, "ngram", "match<=4")
    assert prior < shared < policy.acceptance.alpha(first, "ngram", "match<=4")
    # Other buckets and drafters keep their priors.
    assert policy.acceptance.alpha(second, "ngram", "match<=2") == pytest.approx(PRIOR_ACCEPTANCE["match<=2"])
    assert policy.acceptance.alpha(second, "stub", "match<=4") == pytest.approx(PRIOR_ACCEPTANCE["match<=4"])


def test_observe_ignores_plain_steps_and_empty_drafts() -> None:
    policy = CostAwarePolicy(CostModel(gpu_like()))
    seq = make_seq()
    before = policy.acceptance.alpha(seq, "ngram", "match<=2")
    policy.observe(seq, DraftPlan(), 0)
    policy.observe(seq, DraftPlan(NgramDrafter(), 0, "match<=2"), 0)
    assert policy.acceptance.global_counts == {}
    assert policy.acceptance.alpha(seq, "ngram", "match<=2") == before


@pytest.mark.parametrize("table", [gpu_like, cpu_like])
@pytest.mark.parametrize("prefill_rows", [[], [1], [48], [200, 3]])
def test_prefill_rows_keep_plans_valid(table: Callable[[], StepCostTable], prefill_rows: list[int]) -> None:
    policy = CostAwarePolicy(CostModel(table()))
    seqs = [make_seq(str(i)) for i in range(4)]
    options: list[Options] = [
        ngram_option(16, "match>16"),
        ngram_option(3, "match<=2"),
        {"stub": (StubDrafter(DraftOption(5, "x")), DraftOption(5, "x")), **ngram_option(0, "")},
        {},
    ]
    plans = policy.plan(seqs, options, prefill_rows)
    assert_valid(plans, options)
    assert plans[3] == DraftPlan()
    if table is cpu_like and not prefill_rows:
        assert all(p.drafter is None for p in plans)


@pytest.mark.parametrize("prefill_rows", [[10], [48], [200], [100, 100]])
def test_prefill_in_the_same_pass_does_not_turn_cpu_speculation_on(prefill_rows: list[int]) -> None:
    # On a CPU-like table k drafts add k steps of verify time and at most k tokens, whatever else the pass
    # evaluates: the prompt tokens are paid for either way, so plain decoding stays the better choice.
    policy = CostAwarePolicy(CostModel(cpu_like()))
    options = [ngram_option(16, "match>16"), ngram_option(16, "match<=2")]
    plans = policy.plan([make_seq("a"), make_seq("b")], options, prefill_rows)
    assert plans == [DraftPlan(), DraftPlan()]


def test_draft_model_cost_enters_the_decision() -> None:
    option = DraftOption(8, "", setup_tokens=1)
    options: list[Options] = [{"model-stub": (ModelStub(option), option)}]
    slow_draft = CostModel(gpu_like(), draft=StepCostTable.from_samples({1: STEP, 64: 64 * STEP}))
    fast_draft = CostModel(gpu_like(), draft=StepCostTable.from_samples({1: STEP / 10, 64: 6.4 * STEP}))
    slow = CostAwarePolicy(slow_draft)
    fast = CostAwarePolicy(fast_draft)
    (slow_plan,) = slow.plan([make_seq()], options)
    (fast_plan,) = fast.plan([make_seq()], options)
    assert slow_plan.drafter is None  # a draft step as slow as a target step cannot pay
    assert isinstance(fast_plan.drafter, ModelStub)
    assert fast_plan.setup_tokens == 1
    assert_valid([fast_plan], options)


def test_batch_of_sequences_gets_valid_independent_plans() -> None:
    policy = CostAwarePolicy(CostModel(gpu_like()))
    seqs = [make_seq(str(i)) for i in range(3)]
    options = [ngram_option(6, "match>16"), ngram_option(6, "match>16"), ngram_option(6, "match>16")]
    plans = policy.plan(seqs, options)
    assert_valid(plans, options)
    assert all(p.drafter is not None for p in plans)


# -- fixed length ---------------------------------------------------------------------------------


def test_fixed_policy_takes_the_first_drafter_with_something_to_offer() -> None:
    empty, offers, later = DraftOption(0), DraftOption(5, "b", setup_tokens=2), DraftOption(9, "c")
    first, second, third = StubDrafter(empty), OtherStub(offers), NgramDrafter()
    options: list[Options] = [
        {"stub": (first, empty), "other": (second, offers), "ngram": (third, later)},
        {"ngram": (third, later), "other": (second, offers)},
        {"stub": (first, empty)},
        {},
    ]
    plans = FixedLengthPolicy().plan([make_seq(str(i)) for i in range(4)], options, [100])
    assert plans[0] == DraftPlan(second, 5, "b", 0.0, 2)
    assert plans[1] == DraftPlan(third, 9, "c", 0.0, 0)
    assert plans[2] == DraftPlan()
    assert plans[3] == DraftPlan()
    assert_valid(plans, options)


def test_fixed_policy_learns_nothing() -> None:
    policy = FixedLengthPolicy()
    seq = make_seq()
    policy.observe(seq, DraftPlan(NgramDrafter(), 4, "x"), 0)
    (plan,) = policy.plan([seq], [ngram_option(7, "x")])
    assert plan.num_tokens == 7


def test_the_policy_prices_the_runtimes_own_packing() -> None:
    """The runtime answers how a step's chunks become calls; the policy only sums the calls' costs."""
    asked: list[list[int]] = []

    def packing(chunk_rows: Seq[int], seq_ids: Seq[int] | None) -> list[int]:
        asked.append(list(chunk_rows))
        return one_call(chunk_rows)

    flat = StepCostTable.from_samples({1: STEP, 64: STEP})  # a call costs the same whatever its rows
    policy = CostAwarePolicy(CostModel(flat), call_rows=packing)
    (plan,) = policy.plan([make_seq()], [ngram_option(4, "match>16")], [3])
    assert plan.drafter is not None  # in the prompt chunk's call, drafts are free: drafting pays
    assert asked.count([3]) == 1, "the prompt chunk alone is priced once per plan"
    assert all(rows[0] == 3 for rows in asked), "prompt chunks come first, as the engine orders them"
    # The same costs, but a runtime that runs every row in a call of its own: drafts cost full steps.
    one_row_calls = CostAwarePolicy(CostModel(flat), call_rows=lambda rows, _ids: [1] * sum(rows))
    assert one_row_calls.plan([make_seq()], [ngram_option(4, "match>16")], [3]) == [DraftPlan()]


def stream_passes_of(chunk_rows: Seq[int], seq_ids: Seq[int] | None) -> list[int]:
    """llama.cpp's passes with one KV stream per sequence (what LlamaCppRuntime.call_rows answers)."""
    ids = range(len(chunk_rows)) if seq_ids is None else seq_ids
    return stream_passes(sorted(zip(ids, chunk_rows, strict=True)), 512)


def test_the_policy_prices_the_passes_of_its_sequences_kv_streams() -> None:
    """A pass costs a one-token step whatever its rows (a CPU's floor), and llama.cpp runs sequences whose
    chunks differ in rows as separate passes: a draft for one of two sequences costs a pass of its own,
    drafts for both share one. The policy gives ``call_rows`` the slots (prompt chunks first) to price it."""
    floor = StepCostTable.from_samples({1: STEP, 64: STEP * 2})
    asked: list[list[int] | None] = []

    def passes(chunk_rows: Seq[int], seq_ids: Seq[int] | None) -> list[int]:
        asked.append(None if seq_ids is None else list(seq_ids))
        return stream_passes_of(chunk_rows, seq_ids)

    def scheduled(slot: int) -> Sequence:
        seq = make_seq(f"s{slot}")
        seq.slot = slot
        return seq

    one_drafts = [ngram_option(4, "match<=8"), {}]
    policy = CostAwarePolicy(CostModel(floor), call_rows=passes)
    assert policy.plan([scheduled(0), scheduled(1)], one_drafts, [5], [3]) == [DraftPlan(), DraftPlan()]
    assert asked and all(ids == [3, 0, 1] for ids in asked[1:])  # after the prompt chunk's own price
    # Priced as one call, the same draft looks almost free and is made.
    one_pass = CostAwarePolicy(CostModel(floor), call_rows=lambda rows, _ids: one_call(rows))
    assert one_pass.plan([scheduled(0), scheduled(1)], one_drafts, [], [])[0].drafter is not None
    # Both drafting four tokens: one pass of 10 rows.
    both = policy.plan([scheduled(0), scheduled(1)], [ngram_option(4, "match<=8")] * 2, [], [])
    assert [p.num_tokens for p in both] == [4, 4]


def test_a_draft_that_slows_its_batch_mates_must_gain_its_request_more_than_it_costs_them() -> None:
    """Every sequence waits for the whole pass. A request copying at 0.99 drafts 16 alone; beside three
    with nothing to draft, 16 rows would make their steps 2.5x longer for its 16 tokens: the batch's total
    rises, but the product of the requests' speed-ups falls, and the policy keeps that product (copy-free
    requests fell to 0.70x plain at concurrency 4 when it kept the total). Four copying requests all draft."""
    table = StepCostTable.from_samples({1: STEP, 4: STEP * 1.2, 20: STEP * 3.0, 64: STEP * 8})
    copying: Options = {"suffix": (SuffixDrafter(), DraftOption(16, "match>16", token_probs=(0.99,) * 16))}

    def plan(options: list[Options]) -> list[int]:
        seqs = [make_seq(f"s{slot}") for slot in range(len(options))]
        for slot, seq in enumerate(seqs):
            seq.slot = slot
        unbounded = SpeculationBudget(allowance_steps=1e6)  # the budget is not what is tested here
        plans = CostAwarePolicy(CostModel(table), budget=unbounded).plan(seqs, options, [], [])
        return [p.num_tokens for p in plans]

    assert plan([copying]) == [16]
    beside_three = plan([copying, {}, {}, {}])
    assert beside_three[0] <= 4 and beside_three[1:] == [0, 0, 0]
    assert all(k >= 12 for k in plan([copying] * 4))


class SelfPricedStub(StubDrafter):
    """A drafter that measures its own proposal cost (as the DFlash2 block drafter does)."""

    name = "self-priced"

    def __init__(self, option: DraftOption, seconds: float) -> None:
        super().__init__(option)
        self.seconds = seconds
        self.asked: list[tuple[int, int]] = []

    def draft_seconds(self, num_sequences: int, num_tokens: int) -> float | None:
        self.asked.append((num_sequences, num_tokens))
        return self.seconds * num_sequences


@pytest.mark.parametrize(("draft_cost", "drafts"), [(0.1 * STEP, True), (20 * STEP, False)])
def test_a_self_priced_drafter_drafts_only_where_its_own_cost_allows(draft_cost: float, drafts: bool) -> None:
    """On GPU-like verify costs a block drafter pays when its proposal is cheap, not when it costs more than
    the steps it could save; the price is asked for the batch, once per step."""
    drafter = SelfPricedStub(DraftOption(15, "block16"), draft_cost)
    seqs = [make_seq("a"), make_seq("b")]
    policy = CostAwarePolicy(CostModel(gpu_like()))
    for seq in seqs:
        for _ in range(8):  # a record of full acceptance: alpha near 1
            policy.acceptance.observe(seq, drafter.name, "block16", 15, 15)
    options: list[Options] = [{drafter.name: (drafter, drafter.option)} for _ in seqs]
    plans = policy.plan(seqs, options)
    assert_valid(plans, options)
    assert all((plan.drafter is drafter) == drafts for plan in plans)
    assert not drafts or any(n == 2 for n, _ in drafter.asked)  # both priced as one batched proposal


# -- a drafter's own per-token estimate ------------------------------------------------------------


def suffix_option(probs: tuple[float, ...], bucket: str = "match<=8") -> Options:
    return {"stub": (StubDrafter(DraftOption(len(probs), bucket)), DraftOption(len(probs), bucket, 0, probs))}


def test_a_confident_estimate_drafts_long_and_a_weak_one_drafts_nothing() -> None:
    """The same bucket, two estimates: the drafter's own numbers decide, not the bucket's prior."""
    curve = StepCostTable.from_samples({1: STEP, 2: STEP * 1.8, 4: STEP * 2.2, 16: STEP * 3.0, 64: STEP * 12})
    policy = CostAwarePolicy(CostModel(curve), budget=SpeculationBudget(allowance_steps=100.0))
    confident, weak = (0.99,) * 16, (0.3,) * 16
    strong = policy.plan([make_seq("a")], [suffix_option(confident)])[0]
    assert strong.num_tokens >= 12 and strong.token_probs == confident[: strong.num_tokens]
    assert policy.plan([make_seq("b")], [suffix_option(weak)]) == [DraftPlan()]


def test_expected_tokens_follow_the_estimate_and_its_calibration() -> None:
    plan = DraftPlan(StubDrafter(DraftOption(3)), 3, "b", token_probs=(0.5, 0.5, 0.8), scale=1.0)
    assert plan.expected_tokens() == pytest.approx(1 + 0.5 + 0.25 + 0.2)
    halved = DraftPlan(StubDrafter(DraftOption(3)), 3, "b", token_probs=(0.5, 0.5, 0.8), scale=0.5)
    assert halved.expected_tokens() == pytest.approx(1 + 0.25 + 0.25**2 + 0.25**2 * 0.4)
    raised = DraftPlan(StubDrafter(DraftOption(2)), 2, "b", token_probs=(0.9, 0.9), scale=1.5)
    assert raised.expected_tokens() == pytest.approx(1 + MAX_ACCEPTANCE + MAX_ACCEPTANCE**2)


def test_an_overconfident_drafter_is_calibrated_down_by_its_outcomes() -> None:
    """Drafts whose tokens the drafter rates 0.95 and which keep 1 of 8 (one token accepted, the next
    rejected: a conditional chance of 1/2) lower the (drafter, bucket) scale, for new requests too."""
    curve = StepCostTable.from_samples({1: STEP, 8: STEP * 1.2, 64: STEP * 8})  # drafting is cheap here
    policy = CostAwarePolicy(CostModel(curve), budget=SpeculationBudget(allowance_steps=100.0))
    probs = (0.95,) * 8
    first = policy.plan([make_seq("a")], [suffix_option(probs)])[0]
    assert first.num_tokens >= 6 and first.scale == pytest.approx(1.0)
    for i in range(30):
        seq = make_seq(f"r{i}")
        plan = policy.plan([seq], [suffix_option(probs)])[0]
        if plan.drafter is not None:
            policy.observe(seq, plan, 1)
    later = policy.plan([make_seq("new")], [suffix_option(probs)])[0]
    assert later.drafter is None or (
        later.num_tokens < first.num_tokens and later.expected_tokens() < first.expected_tokens() / 2
    )
    scale = policy.acceptance.scale(make_seq("new"), "stub", "match<=8")
    assert 0.45 < scale < 0.6  # 1 accepted per 0.95 + 0.95 of estimate verified


def test_an_underconfident_drafter_is_calibrated_up_per_token_and_drafts_longer() -> None:
    """A drafter that rates its tokens 0.8 where every one is accepted: the calibration scales each token's
    estimate (to the 0.995 cap), not the draft's total, so the long tail is priced as accepted too."""
    curve = StepCostTable.from_samples({1: STEP, 2: STEP * 1.5, 4: STEP * 1.9, 16: STEP * 3.5, 64: STEP * 12})
    policy = CostAwarePolicy(CostModel(curve), budget=SpeculationBudget(allowance_steps=100.0))
    probs = (0.8,) * 16
    first = policy.plan([make_seq("a")], [suffix_option(probs, "match>16")])[0]
    for i in range(30):
        seq = make_seq(f"r{i}")
        plan = policy.plan([seq], [suffix_option(probs, "match>16")])[0]
        if plan.drafter is not None:
            policy.observe(seq, plan, plan.num_tokens)
    later = policy.plan([make_seq("new")], [suffix_option(probs, "match>16")])[0]
    assert policy.acceptance.scale(make_seq("new"), "stub", "match>16") > 1.2
    assert later.num_tokens > first.num_tokens
    assert later.expected_tokens() > 0.9 * (1 + later.num_tokens)
