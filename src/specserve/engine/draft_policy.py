"""How many tokens to draft, and with which drafter: the plan a policy makes per sequence, what it knows
of acceptance, and the simplest policy (always draft all allowed). The policy that prices plans by their
measured cost is :mod:`specserve.engine.cost_policy`.

Acceptance is estimated per (drafter, bucket) from all requests (a prior for new requests) and per request
(recent behaviour, decayed); a drafter that gives per-token estimates is calibrated by the same counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from specserve.drafters.base import Drafter, DraftOption, estimated_accepted
from specserve.engine.speculation_budget import StepTiming
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
PROVEN_DRAFTS = 1.3
"""The request's own drafts accepted in full, decayed like its record (``_SEQ_DECAY`` per later draft),
before a trusted estimate (cost_policy.py) may draft past its headroom: two such drafts count 1.8 and stay
proven through one later rejection (1.44), not two (1.15)."""
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
        prefill_slots: Seq[int] | None = None,
    ) -> list[DraftPlan]:
        """One plan per sequence; prompt chunks of ``prefill_rows`` tokens (of the sequences in
        ``prefill_slots``, where known) share the same target pass."""
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
        prefill_slots: Seq[int] | None = None,
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
