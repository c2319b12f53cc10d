"""The cost-aware draft policy: how many tokens to draft for each sequence, and with which drafter, to
maximise the geometric mean over the batch's sequences of each one's expected tokens per second::

    rate       = (product over s of tokens(s)) ^ (1 / n) / step_time
    tokens(s)  = 1 + a + a^2 + ... + a^k          (a: estimated chance the next draft token is accepted,
                                                    given the previous one was — a geometric model; or the
                                                    drafter's own per-token estimates, calibrated)
    step_time  = sum over the runtime's passes of target(rows of the pass)   (measured table)
               + draft rounds                      (draft-model only: catch-up batch, then k_max - 1 rounds)

Every sequence waits for the whole step, so a draft that lengthens it must gain its own request more, as a
ratio, than it costs the others (with one sequence this is its tokens per second).

The passes are the runtime's (``ModelRuntime.call_rows``): llama.cpp runs sequences whose chunks differ in
rows, or whose KV streams are not consecutive, as separate passes, so the policy also tries one draft length
for every sequence together, which one sequence at a time would never reach.

It turns speculation on for a sequence only when the best plan beats plain decoding by ``margin``, so
uncertain estimates fall back to plain decoding, and drafts for a request only while it is within its
speculation budget (:mod:`specserve.engine.speculation_budget`: its drafts have not cost it more than a
small share of its time).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from specserve.backends.base import one_call
from specserve.drafters.base import Drafter, DraftOption
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import AcceptanceTracker, DraftLengthPolicy, DraftPlan
from specserve.engine.speculation_budget import SpeculationBudget, StepTiming
from specserve.sequence import Sequence

TRUSTED_DRAFTS = 8.0
"""Drafts of a (drafter, bucket) seen, in this process and this request together, before their acceptance
estimate is trusted with drafts whose rejection would cost more than the request's speculation budget has
left. Below it the estimate is mostly prior (a fresh process): drafts grow with the budget instead. A
trusted estimate still waits for the request's own proof (:meth:`AcceptanceTracker.proven`)."""
SURE_BUCKETS = frozenset({"forced"})
"""Buckets whose drafts need no proof from the request: a grammar's only continuation."""

CallRows = Callable[[Seq[int], Seq[int] | None], list[int]]
"""Chunk sizes of one step, in order, and their sequences' slots (None: unknown) → rows of each pass the
runtime makes (``ModelRuntime.call_rows``)."""


@dataclass(frozen=True)
class _Offer:
    """One drafter's option for one sequence this step, with what the policy knows of its acceptance."""

    drafter: Drafter
    option: DraftOption
    alpha: float  # per-token acceptance (bucket estimate) where the drafter gives no estimates
    scale: float  # the calibration of the drafter's own estimates where it gives them
    trusted: bool  # enough of the request's own drafts seen, and proven: risk is not capped by the budget


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
        """How the target runtime packs a step's chunks into passes (``ModelRuntime.call_rows``): the
        cost of a step is the sum over its passes, so the policy prices exactly what will run."""
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
        prefill_slots: Seq[int] | None = None,
    ) -> list[DraftPlan]:
        plans = [DraftPlan() for _ in seqs]
        slots = _slots(seqs, prefill_slots)
        prefill_seconds = self._call_seconds(
            prefill_rows, None if slots is None else slots[: len(prefill_rows)]
        )

        def rate(trial: list[DraftPlan]) -> float:
            return self._rate(trial, prefill_rows, prefill_seconds, slots)

        # A request that has lost its speculation budget decodes plainly until its share of time restores it.
        one_step = self.costs.target(1)
        headroom = [self.budget.headroom(seq, one_step) for seq in seqs]
        offers = [
            [self._offer(seq, drafter, option) for drafter, option in options[s].values()]
            if headroom[s] >= 0
            else []
            for s, seq in enumerate(seqs)
        ]
        plans, best = self._ascend(plans, rate(plans), offers, headroom, rate)
        if len(seqs) > 1:
            # llama.cpp runs sequences whose chunks differ in rows as separate passes: one sequence's draft
            # may cost a pass of its own where drafts of one length for all share one.
            together = self._together(plans, best, offers, headroom, rate)
            if together is not None:
                plans, best = self._ascend(*together, offers, headroom, rate)
        return plans

    def _offer(self, seq: Sequence, drafter: Drafter, option: DraftOption) -> _Offer:
        if option.token_probs:
            alpha, scale = 0.0, self.acceptance.scale(seq, drafter.name, option.bucket)
        else:
            alpha, scale = self.acceptance.alpha(seq, drafter.name, option.bucket), 1.0
        seen = self.acceptance.evidence(seq, drafter.name, option.bucket)
        proven = option.bucket in SURE_BUCKETS or self.acceptance.proven(seq, drafter.name)
        return _Offer(drafter, option, alpha, scale, seen >= TRUSTED_DRAFTS and proven)

    def _candidate(self, offer: _Offer, k: int, headroom: float, plain: bool) -> DraftPlan | None:
        """``k`` drafts of this offer, or None where the budget does not let the request risk them: on an
        estimate that is still mostly prior, or before the request's own drafts have been accepted, the
        shortest draft that pays may probe (from plain decoding) and longer ones must fit the headroom."""
        drafter, option = offer.drafter, offer.option
        limit = self.budget.risk_limit(headroom, self.costs.target(1), plain)
        if not offer.trusted and self._rejection_cost(drafter, option, k) > limit:
            return None
        return DraftPlan(
            drafter, k, option.bucket, offer.alpha, option.setup_tokens, option.token_probs[:k], offer.scale
        )

    def _ascend(
        self,
        plans: list[DraftPlan],
        best: float,
        offers: list[list[_Offer]],
        headroom: list[float],
        rate: Callable[[list[DraftPlan]], float],
    ) -> tuple[list[DraftPlan], float]:
        """Coordinate ascent: improve one sequence's plan at a time while the batch rate improves."""
        for _ in range(3):
            improved = False
            for s, seq_offers in enumerate(offers):
                for offer in seq_offers:
                    for k in range(1, offer.option.max_tokens + 1):
                        plan = self._candidate(offer, k, headroom[s], plans[s].drafter is None)
                        if plan is None:
                            break
                        trial = [*plans[:s], plan, *plans[s + 1 :]]
                        trial_rate = rate(trial)
                        # Leaving plain decoding needs a clear win: estimates are noisy.
                        needed = best * (1 + self.margin) if plans[s].drafter is None else best
                        if trial_rate > needed:
                            plans, best, improved = trial, trial_rate, True
            if not improved:
                break
        return plans, best

    def _together(
        self,
        plans: list[DraftPlan],
        best: float,
        offers: list[list[_Offer]],
        headroom: list[float],
        rate: Callable[[list[DraftPlan]], float],
    ) -> tuple[list[DraftPlan], float] | None:
        """The best of "every sequence that may draft drafts k" over k (each its likeliest offer, at most
        its own maximum), if it beats ``plans``; None if none does."""
        longest = max((o.option.max_tokens for seq_offers in offers for o in seq_offers), default=0)
        found = None
        for k in range(1, longest + 1):
            trial, leaves_plain = list(plans), False
            for s, seq_offers in enumerate(offers):
                plain = plans[s].drafter is None
                allowed = [
                    self._candidate(o, min(k, o.option.max_tokens), headroom[s], plain) for o in seq_offers
                ]
                candidates = [plan for plan in allowed if plan is not None]
                if candidates:
                    trial[s] = max(candidates, key=DraftPlan.expected_tokens)
                    leaves_plain |= plain
            trial_rate = rate(trial)
            if trial_rate > (best * (1 + self.margin) if leaves_plain else best):
                found, best = (trial, trial_rate), trial_rate
        return found

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

    def _rate(
        self,
        plans: list[DraftPlan],
        prefill_rows: Seq[int],
        prefill_seconds: float,
        slots: Seq[int] | None = None,
    ) -> float:
        """Expected tokens per second of the decoding part of one batch step under ``plans``: the
        geometric mean over its sequences of each one's expected tokens, per second of the step.

        The geometric mean, not the total: every sequence waits for the whole pass, so one request's draft
        slows its batch-mates, and maximising the total let copying requests drag copy-free ones to 0.70x
        plain at concurrency 4. A draft now has to gain its own request more, as a ratio, than it costs the
        others (the product of the requests' speed-ups is maximised); with one sequence both are the same.

        Prompt tokens sharing the pass are paid for whatever the plans are, so only the time they add on top
        of the prompt tokens counts (the marginal cost of the verify positions).
        """
        log_tokens = 0.0
        verify_rows: list[int] = []
        draft_rounds: dict[int, int] = {}
        catch_up = 0
        self_priced: dict[str, tuple[Drafter, list[int]]] = {}  # drafters that measure their own cost
        for plan in plans:
            verify_rows.append(1 + plan.num_tokens)
            if plan.drafter is None:
                continue  # one token: log 1
            log_tokens += math.log(plan.expected_tokens())
            if plan.drafter.draft_seconds(1, plan.num_tokens) is not None:
                self_priced.setdefault(plan.drafter.name, (plan.drafter, []))[1].append(plan.num_tokens)
            elif plan.drafter.uses_model:
                catch_up += plan.setup_tokens
                for r in range(1, plan.num_tokens):
                    draft_rounds[r] = draft_rounds.get(r, 0) + 1
        seconds = max(
            self._call_seconds([*prefill_rows, *verify_rows], slots) - prefill_seconds,
            1e-3 * self.costs.target(1),
        )
        if self.costs.draft is not None and (catch_up or draft_rounds):
            seconds += self.costs.draft(catch_up) + sum(self.costs.draft(n) for n in draft_rounds.values())
        for drafter, lengths in self_priced.values():  # one batched proposal each
            seconds += drafter.draft_seconds(len(lengths), max(lengths)) or 0.0
        return math.exp(log_tokens / max(len(plans), 1)) / seconds if seconds > 0 else 0.0

    def _call_seconds(self, chunk_rows: Seq[int], slots: Seq[int] | None = None) -> float:
        """Target time of a step over chunks of these sizes (prompt chunks first, as the engine orders
        them) of the sequences in ``slots``: the measured cost of each pass, packed as the runtime packs
        them."""
        target = self.costs.target
        return sum(target(n) for n in self.call_rows(chunk_rows, slots)) if chunk_rows else 0.0


def _slots(seqs: Seq[Sequence], prefill_slots: Seq[int] | None) -> list[int] | None:
    """The slots of a step's chunks, prompt chunks first; None where some are unknown (unscheduled)."""
    if prefill_slots is None or any(seq.slot < 0 for seq in seqs):
        return None
    return [*prefill_slots, *(seq.slot for seq in seqs)]
