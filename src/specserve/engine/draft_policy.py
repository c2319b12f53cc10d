"""How many tokens to draft, and with which drafter — including none (plain decoding).

:class:`CostAwarePolicy` maximises expected emitted tokens per second of the whole batch step::

    tokens(s)  = 1 + a + a^2 + ... + a^k          (a: estimated chance the next draft token is accepted,
                                                    given the previous one was — a geometric model)
    step_time  = target(sum over s of (1 + k_s))  (one batched verify pass; measured table)
               + draft rounds                      (draft-model only: catch-up batch, then k_max - 1 rounds)

It turns speculation on for a sequence only when the best plan beats plain decoding by ``margin``, so
uncertain estimates fall back to plain decoding, and drafts for a request only while it is within its
speculation budget (:mod:`specserve.engine.speculation_budget`: its drafts have not cost it more than a
small share of its time). Acceptance is estimated per (drafter, bucket) from all requests (a prior for new
requests) and per request (recent behaviour, decayed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from specserve.backends.base import one_call
from specserve.drafters.base import Drafter, DraftOption, estimated_accepted
from specserve.engine.cost_model import CostModel
from specserve.engine.speculation_budget import SpeculationBudget, StepTiming
from specserve.sequence import Sequence

# Prior acceptance per bucket before anything is measured; long n-gram matches are usually copy regions.
PRIOR_ACCEPTANCE: dict[str, float] = {
    "match<=2": 0.35,
    "match<=4": 0.5,
    "match<=8": 0.65,
    "match<=16": 0.8,
    "match>16": 0.9,
    "forced": 0.98,  # tokens a grammar allows as the only continuation
}
DEFAULT_PRIOR = 0.6
MAX_ACCEPTANCE = 0.995
"""No estimate of a token's acceptance is taken as certain."""
TRUSTED_DRAFTS = 8.0
"""Drafts of a (drafter, bucket) seen, in this process and this request together, before their acceptance
estimate is trusted with drafts whose rejection would cost more than the request's speculation budget has
left. Below it the estimate is mostly prior (a fresh process): drafts grow with the budget instead. A
trusted estimate still waits for the request's own proof (:meth:`AcceptanceTracker.proven`)."""
PROVEN_DRAFTS = 1.3
"""The request's own drafts accepted in full, decayed like its record (``_SEQ_DECAY`` per later draft),
before a trusted estimate may draft past its headroom: two such drafts count 1.8 and stay proven through
one later rejection (1.44), not two (1.15)."""
SURE_BUCKETS = frozenset({"forced"})
"""Buckets whose drafts need no proof from the request: a grammar's only continuation."""
_GLOBAL_PRIOR_WEIGHT = 4.0
_SEQ_PRIOR_WEIGHT = 3.0
_GLOBAL_DECAY = 0.995
_SEQ_DECAY = 0.8
_SEQ_ESTIMATES_KEY = "_estimates"


@dataclass(frozen=True)
class DraftPlan:
    """The decision for one sequence this step; ``drafter is None`` means a plain decoding step."""

    drafter: Drafter | None = None
    num_tokens: int = 0
    bucket: str = ""
    alpha: float = 0.0
    """The acceptance estimate the decision was based on."""
    setup_tokens: int = 0
    """Tokens a model drafter evaluates before its first guess (see DraftOption)."""
    token_probs: tuple[float, ...] = ()
    """The drafter's own per-token estimate (DraftOption.token_probs); when given, it prices the draft
    instead of ``alpha``."""
    scale: float = 1.0
    """The calibration of ``token_probs``: each token's estimate is multiplied by it (capped at
    ``MAX_ACCEPTANCE``; AcceptanceTracker.scale)."""

    def expected_tokens(self) -> float:
        """Tokens the verify step is expected to emit: accepted drafts plus the target's own."""
        if not self.token_probs:
            return expected_tokens(self.alpha, self.num_tokens)
        return 1.0 + estimated_accepted(calibrated(self.token_probs, self.scale))


@dataclass
class _Counts:
    accepted: float = 0.0
    rejected: float = 0.0
    drafts: float = 0.0
    predicted: float = 0.0
    """The drafters' own estimates summed over the drafted tokens the target verified (those up to and
    including the first rejected one): what ``accepted`` would be if the estimates were calibrated."""

    def add(self, num_draft: int, num_accepted: int, decay: float, predicted: float = 0.0) -> None:
        self.accepted = self.accepted * decay + num_accepted
        self.rejected = self.rejected * decay + (1.0 if num_accepted < num_draft else 0.0)
        self.drafts = self.drafts * decay + 1.0
        self.predicted = self.predicted * decay + predicted

    def posterior(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)

    def scale(self, prior: float, weight: float) -> float:
        """Accepted tokens over their estimates' sum, starting from ``prior`` with ``weight`` estimated."""
        return (self.accepted + prior * weight) / (self.predicted + weight)


@dataclass
class AcceptanceTracker:
    """Running acceptance estimates: global per (drafter, bucket), refined per request; and, apart from
    them, the calibration of drafters that estimate their own drafts."""

    global_counts: dict[tuple[str, str], _Counts] = field(default_factory=dict)
    estimate_counts: dict[tuple[str, str], _Counts] = field(default_factory=dict)
    """Per (drafter, bucket): drafts that carried the drafter's own estimate, with what it predicted."""

    def alpha(self, seq: Sequence, drafter: str, bucket: str) -> float:
        """Acceptance estimate: the global (drafter, bucket) posterior, refined by this request's record.

        The request's own record is kept per drafter, not per bucket: a request that is copying its input
        accepts long runs whatever the match length says, and one that is not rejects even long matches.
        """
        prior = PRIOR_ACCEPTANCE.get(bucket, DEFAULT_PRIOR)
        global_alpha = self.global_counts.get((drafter, bucket), _Counts()).posterior(
            prior, _GLOBAL_PRIOR_WEIGHT
        )
        own = self._seq_counts(seq).get(drafter, _Counts())
        return min(own.posterior(global_alpha, _SEQ_PRIOR_WEIGHT), MAX_ACCEPTANCE)

    def scale(self, seq: Sequence, drafter: str, bucket: str) -> float:
        """Calibration of a drafter's own per-token estimates: of the drafted tokens the target verified,
        how many were accepted per unit of estimated chance — globally per (drafter, bucket) from 1.0 (the
        estimate taken as it is), refined by this request's record. Per token, not per draft: a drafter
        that says 0.9 where its copies are accepted at 0.97 is under-confident about every token, and
        scaling a draft's total instead would keep its long drafts under-priced (the geometric tail)."""
        counts = self.estimate_counts.get((drafter, bucket), _Counts())
        global_scale = counts.scale(1.0, _GLOBAL_PRIOR_WEIGHT)
        own = self._seq_counts(seq, _SEQ_ESTIMATES_KEY).get(drafter, _Counts())
        return min(own.scale(global_scale, _SEQ_PRIOR_WEIGHT), 2.0)

    def evidence(self, seq: Sequence, drafter: str, bucket: str) -> float:
        """Drafts behind ``alpha``'s estimate beyond its prior: the (drafter, bucket)'s in this process
        (decayed) plus this request's own with the drafter."""
        seen = self.global_counts.get((drafter, bucket), _Counts()).drafts
        return seen + self._seq_counts(seq).get(drafter, _Counts()).drafts

    def proven(self, seq: Sequence, drafter: str) -> bool:
        """The request's own recent drafts with ``drafter`` were accepted in full (``PROVEN_DRAFTS``).

        Why a trusted estimate waits for it: a bucket's global record mixes workloads. On a server that has
        been copying code, a 9-16 token match estimates 0.99 acceptance; a Q&A answer that repeats a phrase
        of its question matches as long and accepts one token. Its first draft of 14 cost 6.5 steps for 2
        tokens (AMD EPYC Zen 5), 5 % of a 96-token answer, where a probe costs under 2 steps; a copying
        request drafts long after two accepted probes. Two rather than one: a short probe is accepted by
        chance often enough that one proof let the next, long, draft fail (tests/engine/
        test_speculation_budget.py simulates both)."""
        own = self._seq_counts(seq).get(drafter, _Counts())
        return own.drafts - own.rejected >= PROVEN_DRAFTS

    def observe(
        self,
        seq: Sequence,
        drafter: str,
        bucket: str,
        num_draft: int,
        num_accepted: int,
        token_probs: tuple[float, ...] = (),
    ) -> None:
        """Book a verify outcome; a draft with the drafter's own estimate also books what it predicted."""
        if num_draft <= 0:
            return
        self.global_counts.setdefault((drafter, bucket), _Counts()).add(
            num_draft, num_accepted, _GLOBAL_DECAY
        )
        self._seq_counts(seq).setdefault(drafter, _Counts()).add(num_draft, num_accepted, _SEQ_DECAY)
        if token_probs:
            predicted = sum(token_probs[: min(num_accepted + 1, num_draft)])
            self.estimate_counts.setdefault((drafter, bucket), _Counts()).add(
                num_draft, num_accepted, _GLOBAL_DECAY, predicted
            )
            self._seq_counts(seq, _SEQ_ESTIMATES_KEY).setdefault(drafter, _Counts()).add(
                num_draft, num_accepted, _SEQ_DECAY, predicted
            )

    @staticmethod
    def _seq_counts(seq: Sequence, key: str = "_acceptance") -> dict[str, _Counts]:
        """The request's own counts per drafter (``key``: its acceptance record, or its estimates')."""
        counts = seq.drafter_state.setdefault(key, {})
        assert isinstance(counts, dict)
        return counts


CallRows = Callable[[Seq[int]], list[int]]
"""Chunk sizes of one step, in order → rows of each backend call (``ModelRuntime.call_rows``)."""


def calibrated(token_probs: Seq[float], scale: float) -> tuple[float, ...]:
    """A drafter's per-token estimates under its calibration ``scale``."""
    return tuple(min(p * scale, MAX_ACCEPTANCE) for p in token_probs)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by a verify step with k drafts: accepted drafts plus one target token."""
    return sum(alpha**i for i in range(k + 1))


class DraftLengthPolicy:
    """Interface: choose a plan per sequence from each drafter's option."""

    def plan(
        self,
        seqs: Seq[Sequence],
        options: Seq[Mapping[str, tuple[Drafter, DraftOption]]],
        prefill_rows: Seq[int] = (),
    ) -> list[DraftPlan]:
        """One plan per sequence; prompt chunks of ``prefill_rows`` tokens share the same target pass."""
        raise NotImplementedError

    def observe(self, seq: Sequence, plan: DraftPlan, num_accepted: int) -> None:
        """Learn from a verify outcome (default: nothing)."""

    def observe_step(self, seq: Sequence, num_drafts: int, num_accepted: int, step: StepTiming) -> None:
        """Book a decoding step of ``seq`` (plain ones too) and the pass it ran in (default: nothing)."""


class FixedLengthPolicy(DraftLengthPolicy):
    """Always draft as much as allowed with the first drafter that has something (textbook speculation)."""

    def plan(
        self,
        seqs: Seq[Sequence],
        options: Seq[Mapping[str, tuple[Drafter, DraftOption]]],
        prefill_rows: Seq[int] = (),
    ) -> list[DraftPlan]:
        plans = []
        for opts in options:
            plan = DraftPlan()
            for drafter, option in opts.values():
                if option.max_tokens > 0:
                    plan = DraftPlan(drafter, option.max_tokens, option.bucket, 0.0, option.setup_tokens)
                    break
            plans.append(plan)
        return plans


class CostAwarePolicy(DraftLengthPolicy):
    """Maximise expected tokens per second from measured costs and running acceptance estimates."""

    def __init__(
        self,
        costs: CostModel,
        margin: float = 0.03,
        call_rows: CallRows = one_call,
        budget: SpeculationBudget | None = None,
    ) -> None:
        self.costs = costs
        self.margin = margin
        self.call_rows = call_rows
        """How the target runtime packs a step's chunks into backend calls (``ModelRuntime.call_rows``):
        the cost of a step is the sum over its calls, so the policy prices exactly what will run."""
        self.acceptance = AcceptanceTracker()
        self.budget = SpeculationBudget() if budget is None else budget
        """Bounds each request's time lost to speculation that did not pay (speculation_budget.py)."""

    def observe(self, seq: Sequence, plan: DraftPlan, num_accepted: int) -> None:
        if plan.drafter is not None:
            self.acceptance.observe(
                seq, plan.drafter.name, plan.bucket, plan.num_tokens, num_accepted, plan.token_probs
            )

    def observe_step(self, seq: Sequence, num_drafts: int, num_accepted: int, step: StepTiming) -> None:
        self.budget.book(seq, num_drafts, num_accepted, step, self.costs.target)

    def plan(
        self,
        seqs: Seq[Sequence],
        options: Seq[Mapping[str, tuple[Drafter, DraftOption]]],
        prefill_rows: Seq[int] = (),
    ) -> list[DraftPlan]:
        plans = [DraftPlan() for _ in seqs]
        prefill_seconds = self._call_seconds(prefill_rows)
        best = self._rate(plans, prefill_rows, prefill_seconds)
        # Coordinate ascent: improve one sequence's plan at a time while the batch rate improves.
        # A request that has lost its speculation budget decodes plainly until its share of time restores it;
        # on an estimate that is still mostly prior, or before the request's own drafts have been accepted,
        # a draft may risk only what the budget has left (or probe).
        one_step = self.costs.target(1)
        headroom = [self.budget.headroom(seq, one_step) for seq in seqs]
        for _ in range(3):
            improved = False
            for s, seq in enumerate(seqs):
                for drafter, option in options[s].values() if headroom[s] >= 0 else ():
                    if option.token_probs:
                        alpha, scale = 0.0, self.acceptance.scale(seq, drafter.name, option.bucket)
                    else:
                        alpha, scale = self.acceptance.alpha(seq, drafter.name, option.bucket), 1.0
                    seen = self.acceptance.evidence(seq, drafter.name, option.bucket)
                    proven = option.bucket in SURE_BUCKETS or self.acceptance.proven(seq, drafter.name)
                    trusted = seen >= TRUSTED_DRAFTS and proven
                    for k in range(1, option.max_tokens + 1):
                        # Untrusted: the shortest draft that pays may probe; longer ones fit the headroom.
                        limit = self.budget.risk_limit(headroom[s], one_step, plans[s].drafter is None)
                        if not trusted and self._rejection_cost(drafter, option, k) > limit:
                            break
                        plan = DraftPlan(
                            drafter,
                            k,
                            option.bucket,
                            alpha,
                            option.setup_tokens,
                            option.token_probs[:k],
                            scale,
                        )
                        trial = [*plans[:s], plan, *plans[s + 1 :]]
                        rate = self._rate(trial, prefill_rows, prefill_seconds)
                        # Leaving plain decoding needs a clear win: estimates are noisy.
                        needed = best * (1 + self.margin) if plans[s].drafter is None else best
                        if rate > needed:
                            plans, best, improved = trial, rate, True
            if not improved:
                break
        return plans

    def _rejection_cost(self, drafter: Drafter, option: DraftOption, k: int) -> float:
        """What ``k`` drafts cost one sequence if none is accepted: the verify rows they add to its pass,
        and drafting them (a draft model's rounds, or a drafter's own measured price)."""
        seconds = self.costs.target(1 + k) - self.costs.target(1)
        own = drafter.draft_seconds(1, k)
        if own is not None:
            return seconds + own
        if drafter.uses_model and self.costs.draft is not None:
            seconds += self.costs.draft(option.setup_tokens) + (k - 1) * self.costs.draft(1)
        return seconds

    def _rate(self, plans: list[DraftPlan], prefill_rows: Seq[int], prefill_seconds: float) -> float:
        """Expected tokens per second of the decoding part of one batch step under ``plans``.

        Prompt tokens sharing the pass are paid for whatever the plans are, so only the time they add on top
        of the prompt tokens counts (the marginal cost of the verify positions).
        """
        tokens = 0.0
        verify_rows: list[int] = []
        draft_rounds: dict[int, int] = {}
        catch_up = 0
        self_priced: dict[str, tuple[Drafter, list[int]]] = {}  # drafters that measure their own cost
        for plan in plans:
            verify_rows.append(1 + plan.num_tokens)
            if plan.drafter is None:
                tokens += 1.0
                continue
            tokens += plan.expected_tokens()
            if plan.drafter.draft_seconds(1, plan.num_tokens) is not None:
                self_priced.setdefault(plan.drafter.name, (plan.drafter, []))[1].append(plan.num_tokens)
            elif plan.drafter.uses_model:
                catch_up += plan.setup_tokens
                for r in range(1, plan.num_tokens):
                    draft_rounds[r] = draft_rounds.get(r, 0) + 1
        seconds = max(
            self._call_seconds([*prefill_rows, *verify_rows]) - prefill_seconds, 1e-3 * self.costs.target(1)
        )
        if self.costs.draft is not None and (catch_up or draft_rounds):
            seconds += self.costs.draft(catch_up) + sum(self.costs.draft(n) for n in draft_rounds.values())
        for drafter, lengths in self_priced.values():  # one batched proposal each
            seconds += drafter.draft_seconds(len(lengths), max(lengths)) or 0.0
        return tokens / seconds if seconds > 0 else 0.0

    def _call_seconds(self, chunk_rows: Seq[int]) -> float:
        """Target time of a pass over chunks of these sizes (prompt chunks first, as the engine orders
        them): the measured cost of each backend call, packed as the runtime packs them."""
        target = self.costs.target
        return sum(target(n) for n in self.call_rows(chunk_rows)) if chunk_rows else 0.0
