"""A request's speculation budget: the cost policy may lose only a bounded share of time to plain decoding.

The policy drafts where its estimates say drafting pays, and estimates start from priors: a fresh process
(a user's one ``specserve generate``) has no acceptance history, and a long n-gram match that the model does
not follow costs a verify pass of many rows for one token. A warm server has learned which matches pay; a
first request has not. The budget makes "never much slower than plain" a rule rather than a hope: every
request keeps a ledger of what its speculative steps cost beyond the plain steps they replaced and what
their accepted drafts saved, and the policy may draft for it only while the net loss stays within
``share`` of the request's decoding time plus an ``allowance`` of one one-token step (the price of finding
out); past it, the request decodes plainly until its share of time restores the budget. Gains (copying text)
build up credit, so speculation that pays is never stopped. While the policy's acceptance estimate is still
mostly prior (a fresh process: ``TRUSTED_DRAFTS`` in cost_policy.py), a draft may not risk more than the
headroom left (its rejection cost), so drafts grow with the credit earned: the request then loses at most
its budget, plus one probe (the shortest draft that pays, where even that does not fit the headroom). On a
trusted estimate, once two of the request's own drafts have been accepted in full, one draft may overshoot it
(long drafts are what pay on a CPU); before that, a warm server probes too, since a bucket's record from
other requests does not say whether this one is copying.

How a step is booked, for a sequence that drafted k tokens and had a accepted in a pass of R rows that took
W seconds: without its drafts the pass would have taken P = cost(R - k) (the cost table, which the engine
refines with every pass), and the a accepted tokens would each have needed a step of about P. So the step
lost (W - P) + drafting time - a * P. For a request alone, P is the one-token cost, which a fresh process
has just measured (calibration or the probe that validates a cached table). W is the measured pass, not the
table's cost(R): a table that underprices verify rows, the likeliest error of a fresh process, then shows
as loss instead of hiding it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.engine.cost_model import StepCostTable
from specserve.sequence import Sequence

_STATE_KEY = "_speculation_budget"


@dataclass
class Ledger:
    """One request's account: decoding time so far and net time lost to speculation (negative: gained)."""

    seconds: float = 0.0
    loss: float = 0.0
    draft_seconds_seen: float = 0.0
    """``seq.draft_seconds`` at the last booking (it is cumulative)."""


@dataclass(frozen=True)
class StepTiming:
    """The target pass a verify step ran in: its duration and its rows (every sequence's)."""

    seconds: float
    rows: int


@dataclass
class SpeculationBudget:
    share: float = 0.012
    """Loss allowed as a share of the request's decoding time (below the 0.97x bar, leaving room for the one
    draft that may overshoot)."""
    allowance_steps: float = 1.0
    """Loss any request may risk before its own record speaks, in one-token steps."""
    probe_steps: float = 2.0
    """What the shortest draft that pays may risk on an estimate still mostly prior, in one-token steps, even
    beyond the headroom (while the request is within its budget). Where an extra verify row costs nearly a
    step (AMD Zen 5: 3 rows cost 2.55 steps), no draft short enough to fit one step's allowance pays, and a
    request could never start to earn credit; with the probe it risks one draft (1.5 steps there), and a
    failed one leaves it below its budget until its share of time restores it."""

    def headroom(self, seq: Sequence, one_step_seconds: float) -> float:
        """Seconds ``seq`` may still lose; below zero the policy drafts nothing for it.

        A cap on the next draft's worst case only while the acceptance estimate is mostly prior: on a CPU
        only long drafts pay (an extra row costs nearly a step at small k), so a request that copies its
        input, on a server that has seen such requests, must be free to draft 16 tokens long before its
        own credit would cover their rejection. There the overshoot is one draft."""
        ledger = ledger_of(seq)
        return self.share * ledger.seconds + self.allowance_steps * one_step_seconds - ledger.loss

    def risk_limit(self, headroom: float, one_step_seconds: float, probing: bool) -> float:
        """The most an untrusted draft of a request with ``headroom`` seconds left may cost if rejected;
        ``probing``: the request has no cheaper draft planned this step (the shortest that pays)."""
        if probing and headroom >= 0:
            return max(headroom, self.probe_steps * one_step_seconds)
        return headroom

    def book(
        self, seq: Sequence, num_drafts: int, num_accepted: int, step: StepTiming, costs: StepCostTable
    ) -> None:
        """Book one decoding step of ``seq`` (a plain one too: it adds to the time the share is of)."""
        ledger = ledger_of(seq)
        drafting = max(seq.draft_seconds - ledger.draft_seconds_seen, 0.0)
        ledger.draft_seconds_seen = seq.draft_seconds
        ledger.seconds += step.seconds + drafting
        if num_drafts <= 0 or step.rows <= num_drafts:
            return
        plain = costs(step.rows - num_drafts)
        ledger.loss += (step.seconds - plain) + drafting - num_accepted * plain


def ledger_of(seq: Sequence) -> Ledger:
    ledger = seq.drafter_state.setdefault(_STATE_KEY, Ledger())
    assert isinstance(ledger, Ledger)
    return ledger
