"""The drafting half of an engine step: what each allowed drafter could offer, the draft policy's plans, one
batched proposal per chosen drafter.

A drafter never fails a request: one that raises leaves its sequences with plain steps (their drafter state
reset), and one that keeps failing (``MAX_DRAFTER_FAILURES``) is taken out of the engine.
"""

from __future__ import annotations

import logging
import time

from specserve.backends.base import RuntimeInfo
from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.drafters.grammar import GrammarDrafter
from specserve.engine.draft_policy import DraftLengthPolicy, DraftPlan
from specserve.engine.options import EngineOptions
from specserve.engine.stats import EngineStats
from specserve.sequence import Sequence

log = logging.getLogger("specserve.engine")

MAX_DRAFTER_FAILURES = 3


class Drafting:
    """Plans and proposals for the decoding sequences of a step."""

    def __init__(
        self, drafters: dict[str, Drafter], policy: DraftLengthPolicy, info: RuntimeInfo, stats: EngineStats
    ) -> None:
        self.drafters = drafters
        """The engine's own dict: a drafter disabled here is gone for the engine too."""
        self.policy = policy
        self.info = info
        self.stats = stats
        self._failures: dict[str, int] = {}
        self.forced = GrammarDrafter()
        """Offered beside the allowed drafters to every request with a grammar (drafters/grammar.py)."""

    def plan(
        self, seqs: list[Sequence], prefills: list[tuple[Sequence, int]], options: EngineOptions
    ) -> list[DraftPlan]:
        """Ask each allowed drafter what it could offer, then let the policy decide (0 tokens = plain)."""
        offers: list[dict[str, tuple[Drafter, DraftOption]]] = []
        for seq in seqs:
            allowed: dict[str, tuple[Drafter, DraftOption]] = {}
            limit = self._draft_limit(seq, options)
            if seq.grammar is not None and limit > 0 and self._speculating(seq, options):
                allowed[self.forced.name] = (self.forced, self.forced.available(seq, limit))  # first: surest
            for name in self._allowed_drafters(seq, options) if limit > 0 else ():
                drafter = self.drafters[name]
                try:
                    allowed[name] = (drafter, drafter.available(seq, limit))
                except Exception as exc:  # a drafter must never fail a request
                    self._drafter_failed(name, [seq], exc)
            offers.append(allowed)
        if not any(offers):
            return [DraftPlan() for _ in seqs]
        return self.policy.plan(seqs, offers, [n for _, n in prefills], [seq.slot for seq, _ in prefills])

    @staticmethod
    def _speculating(seq: Sequence, options: EngineOptions) -> bool:
        spec = seq.speculation
        return options.speculation_enabled and spec.enabled is not False and spec.drafter != "none"

    def _allowed_drafters(self, seq: Sequence, options: EngineOptions) -> tuple[str, ...]:
        spec = seq.speculation
        if not self._speculating(seq, options):
            return ()
        if spec.drafter not in (None, "auto"):
            return (spec.drafter,) if spec.drafter in self.drafters else ()
        loaded = [n for n in options.drafters if n in self.drafters]
        covered = {c for n in loaded for c in self.drafters[n].covers}
        return tuple(n for n in loaded if n not in covered)

    def _draft_limit(self, seq: Sequence, options: EngineOptions) -> int:
        """Draft tokens allowed for seq: the configured bound, and room left in its context."""
        bound = seq.speculation.num_draft_tokens
        bound = options.num_draft_tokens if bound is None else bound
        room = self.info.context_per_sequence - seq.num_tokens
        left = seq.params.max_tokens - len(seq.output_ids) - 1  # the verify step emits one more itself
        exact_cap = self.info.max_verify_tokens - 1
        return max(0, min(bound, room, left, exact_cap))

    def propose(self, seqs: list[Sequence], plans: list[DraftPlan]) -> list[Proposal]:
        """Run each chosen drafter once over all its sequences; a failing drafter means plain steps."""
        proposals = [Proposal([]) for _ in seqs]
        by_drafter: dict[str, list[int]] = {}
        chosen: dict[str, Drafter] = {}
        for i, plan in enumerate(plans):
            if plan.drafter is not None and plan.num_tokens > 0:
                by_drafter.setdefault(plan.drafter.name, []).append(i)
                chosen[plan.drafter.name] = plan.drafter
        for name, idx in by_drafter.items():
            drafter = chosen[name]
            start = time.perf_counter()
            try:
                got = drafter.propose([seqs[i] for i in idx], [plans[i].num_tokens for i in idx])
            except Exception as exc:  # a drafter must never fail a request
                self._drafter_failed(name, [seqs[i] for i in idx], exc)
                continue
            elapsed = time.perf_counter() - start
            for i, proposal in zip(idx, got, strict=True):
                assert len(proposal.token_ids) <= plans[i].num_tokens, "drafter proposed too many tokens"
                proposals[i] = proposal
                seqs[i].draft_seconds += elapsed / len(idx)
            self.stats.draft_seconds += elapsed
        return proposals

    def committed(self, seq: Sequence, chunk: int, start: int, count: int) -> None:
        """Tell the drafters that read the target's hidden states which rows of its last pass became
        ``seq``'s committed tokens (positions ``start …``). A drafter that raises counts as failed."""
        for name, drafter in list(self.drafters.items()):
            if drafter.reads_target_states:
                try:
                    drafter.committed(seq, chunk, start, count)
                except Exception as exc:  # a drafter must never fail a request
                    self._drafter_failed(name, [seq], exc)

    def _drafter_failed(self, name: str, seqs: list[Sequence], exc: BaseException) -> None:
        self._failures[name] = self._failures.get(name, 0) + 1
        self.stats.drafter_failures += 1
        log.warning("drafter %s failed (%s); %d requests continue without it", name, exc, len(seqs))
        drafter = self.forced if name == self.forced.name else self.drafters[name]
        for seq in seqs:
            try:
                drafter.release(seq)
                drafter.begin(seq)
            except Exception:  # the drafter is already broken; its state is dropped with it
                log.debug("drafter %s could not reset its state", name, exc_info=True)
        if self._failures[name] >= MAX_DRAFTER_FAILURES:
            log.error("drafter %s disabled after %d failures", name, self._failures[name])
            self.drafters.pop(name, None)
