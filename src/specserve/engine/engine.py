"""The speculative decoding engine: one step = schedule → draft → verify → commit/rollback → emit.

Every emitted token is the target's own choice from the pass that evaluated it: a draft token is emitted
only when verification says the target would have produced it (greedy) or accepts it losslessly (sampling).
Plain decoding is this same loop with zero draft tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from specserve.backends.base import DecodeChunk, ModelRuntime, StepLogits
from specserve.drafters.base import Drafter, Proposal
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import DraftLengthPolicy, DraftPlan
from specserve.engine.drafting import Drafting
from specserve.engine.emitting import Emitting, emitted_logprobs, verify_request
from specserve.engine.options import EngineOptions
from specserve.engine.outputs import EngineOutput, request_end, request_start
from specserve.engine.prefix_cache import PrefixCache
from specserve.engine.prompt_logprobs import prefill_rows, take_prompt_logprobs
from specserve.engine.scheduler import ScheduledBatch, Scheduler
from specserve.engine.speculation_budget import StepTiming
from specserve.engine.stats import EngineStats
from specserve.engine.step_log import StepLog
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import Sequence, SequenceStatus, SpeculationOptions
from specserve.structured.grammar import GrammarCompiler
from specserve.verify import Verifier, VerifyRequest, verifier_for
from specserve.verify.logprobs import TokenLogprobs

log = logging.getLogger("specserve.engine")


class SpeculativeEngine:
    """Runs many sequences at once on one target runtime with pluggable drafters."""

    def __init__(
        self,
        target: ModelRuntime[Any],
        drafters: Mapping[str, Drafter],
        policy: DraftLengthPolicy,
        costs: CostModel,
        options: EngineOptions | None = None,
        prefill_budget: int = 256,
        prefix_cache: PrefixCache | None = None,
        verifier: Verifier[Any] | None = None,
    ) -> None:
        """``verifier``: the default is the one made for where the target leaves its logits."""
        self.target = target
        self.verifier = verifier or verifier_for(target.info.logits_device)
        self.drafters = dict(drafters)
        self.policy = policy
        self.costs = costs
        self.options = options or EngineOptions()
        self.prefix_cache = prefix_cache
        admit = prefix_cache.admit if prefix_cache is not None else None
        self.scheduler = Scheduler(target.info.max_sequences, prefill_budget, admit)
        self.stats = EngineStats()
        self.drafting = Drafting(self.drafters, policy, target.info, self.stats)
        self.grammars = GrammarCompiler(target, target.info.vocab_size)
        """Structured outputs' grammars for this target (llguidance loads on the first one)."""
        self._step_tokens = 0  # rows of the step's target pass (its cost is observed after verification)
        self._step_timing = StepTiming(0.0, 0)
        self._step_passes: list[int] = []  # rows of each pass it ran as (llama.cpp splits by KV stream)
        self._step_priced = 0.0  # the cost table's price of those passes (kept for the step log)
        self.step_log: StepLog | None = None
        """Where each step's line goes (the ``step_log`` setting); None: nothing is written or computed."""
        self._step_seconds = 0.0

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        speculation: SpeculationOptions | None = None,
        cache_salt: str = "",
    ) -> Sequence:
        context = self.target.info.context_per_sequence
        if not prompt_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(prompt_ids) >= context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the context holds {context}")
        if self.scheduler.find(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.target.info.vocab_size
        if (field := params.unknown_token_ids(vocab)) is not None:
            raise ValueError(f"token ids in {field} must be in [0, {vocab})")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, list(prompt_ids), params, PositionalUniforms(seed))
        if params.grammar is not None:
            seq.grammar = self.grammars.state(params.grammar)
        seq.speculation = speculation or SpeculationOptions()
        seq.cache_salt = cache_salt
        name = seq.speculation.drafter
        if name is not None and name not in self.drafters and name not in ("none", "auto"):
            raise ValueError(
                f"drafter {name!r} is not available; loaded: {', '.join(self.drafters) or 'none'}"
            )
        for drafter in self.drafters.values():
            drafter.begin(seq)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str, reason: Literal["abort", "stop"] = "abort") -> EngineOutput | None:
        """End a request now and free its KV memory (``stop``: the output processor found a stop string in
        its text); its last output, or None when the request is not here (it has already ended)."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        seq.finish(reason)
        self._release(seq)
        return EngineOutput(request_id, [], reason, end=request_end(seq))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- state the server reads, and its switch ---------------------------------------------------

    def switch_speculation(self, enabled: bool) -> None:
        """The server-wide switch: off runs every request as plain decoding from its next step; on resumes
        drafting (drafters catch up on the tokens they missed)."""
        self.options = dataclasses.replace(self.options, speculation_enabled=enabled)

    def disabled_drafters(self) -> list[str]:
        """Configured drafters that were disabled after repeated failures."""
        return [name for name in self.options.drafters if name not in self.drafters]

    def speculation_active(self) -> bool:
        """The switch is on and at least one configured drafter is still loaded."""
        return self.options.speculation_enabled and any(n in self.drafters for n in self.options.drafters)

    @property
    def last_pass(self) -> StepTiming:
        """The last step's target pass: its seconds (the runtime's own timing, or the host's around
        ``decode``) and its rows, every sequence's."""
        return self._step_timing

    def kv_usage(self) -> float:
        """Tokens the running sequences hold, as a share of the KV cache, in [0, 1]."""
        capacity = self.target.info.context_per_sequence * self.scheduler.max_running
        used = sum(seq.num_tokens for seq in list(self.scheduler.running))
        return min(1.0, used / capacity) if capacity else 0.0

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Schedule → plan and draft → one target pass → one batched verification → commit → emit."""
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        plans = self.drafting.plan(batch.decodes, batch.prefills, self.options)
        proposals = self.drafting.propose(batch.decodes, plans)
        logits = self._evaluate(batch.prefills, batch.decodes, proposals)
        emitting = self._emitting(batch.prefills, batch.decodes, plans, proposals)
        emitted = self._verify(emitting, logits)
        logprobs = emitted_logprobs(emitting, emitted, logits)
        self._account(batch.prefills, batch.decodes)
        if self.step_log is not None:
            self._log_step(batch, emitting, emitted)
        outputs = [
            self._isolated(e.seq, self._commit_step, e, tokens, entries)
            for e, tokens, entries in zip(emitting, emitted, logprobs, strict=True)
        ]
        return [o for o in outputs if o is not None]

    def _isolated(
        self, seq: Sequence, fn: Callable[..., EngineOutput | None], *args: object
    ) -> EngineOutput | None:
        """Verify and commit one sequence; if that raises, only this request fails (finish reason
        ``error``, its KV freed) and the step goes on for the others."""
        try:
            return fn(*args)
        except Exception:
            log.exception("request %s failed in the engine; the other requests continue", seq.request_id)
            if not seq.finished:
                seq.finish("error")
            self._release(seq)
            return EngineOutput(seq.request_id, [], seq.finish_reason, end=request_end(seq))

    def _evaluate(
        self, prefills: list[tuple[Sequence, int]], decodes: list[Sequence], proposals: list[Proposal]
    ) -> StepLogits[Any]:
        """One target pass over prompt chunks and verify batches ([pending] + draft tokens) together."""
        chunks = []
        for seq, n in prefills:
            pos = seq.num_computed
            chunks.append(
                DecodeChunk(seq.slot, seq.prompt_ids[pos : pos + n], pos, prefill_rows(seq, pos, n))
            )
        for seq, proposal in zip(decodes, proposals, strict=True):
            verify = [seq.tokens[-1], *proposal.token_ids]
            chunks.append(DecodeChunk(seq.slot, verify, seq.num_computed, len(verify)))
        self._step_tokens = sum(len(c.tokens) for c in chunks)
        self._step_passes = self.target.call_rows([len(c.tokens) for c in chunks], [c.seq_id for c in chunks])
        start = time.perf_counter()
        logits = self.target.decode(chunks)
        self._step_seconds = time.perf_counter() - start
        logits = take_prompt_logprobs(prefills, logits)
        for chunk, (seq, n) in enumerate(prefills):
            self.drafting.committed(seq, chunk, seq.num_computed, n)
            seq.num_computed += n
        return logits

    def _log_step(
        self, batch: ScheduledBatch, emitting: list[Emitting], emitted: list[list[int] | Exception]
    ) -> None:
        assert self.step_log is not None
        timing = self._step_timing
        self.step_log.record(batch, emitting, emitted, self._step_passes, timing.seconds, self._step_priced)

    def _account(self, prefills: list[tuple[Sequence, int]], decodes: list[Sequence]) -> None:
        """The target pass's cost into the cost model and the stats, once the step's ids are verified: a
        device runtime times its own work (it returns from ``decode`` before that work is done, and its
        verifier's one transfer is where the host waits), a host runtime is timed around ``decode``."""
        device_seconds = self.target.last_decode_seconds()
        elapsed = self._step_seconds if device_seconds is None else device_seconds
        self._step_timing = StepTiming(elapsed, self._step_tokens)
        if self.step_log is not None:  # the price the policy planned with, before this step refines it
            self._step_priced = sum(self.costs.target(n) for n in self._step_passes)
        if not prefills and len(self._step_passes) == 1:  # several passes are not one table entry
            self.costs.target.observe(self._step_tokens, elapsed)
        self.stats.verify_seconds += elapsed
        for seq in decodes:
            seq.verify_seconds += elapsed / len(decodes)

    # -- verify ------------------------------------------------------------------------------------

    def _emitting(
        self,
        prefills: list[tuple[Sequence, int]],
        decodes: list[Sequence],
        plans: list[DraftPlan],
        proposals: list[Proposal],
    ) -> list[Emitting]:
        """The sequences that emit tokens this step, in the order of their logits rows: those whose last
        prompt chunk was just evaluated (their first token), then every decoding sequence."""
        emitting = [
            self._emitter(seq, chunk, [], None, None)
            for chunk, (seq, _) in enumerate(prefills)
            if not seq.is_prefilling
        ]
        for i, (seq, plan, proposal) in enumerate(zip(decodes, plans, proposals, strict=True)):
            emitting.append(
                self._emitter(seq, len(prefills) + i, proposal.token_ids, proposal.draft_probs, plan)
            )
        return emitting

    def _emitter(
        self, seq: Sequence, chunk: int, drafts: list[int], draft_probs: Any, plan: DraftPlan | None
    ) -> Emitting:
        try:
            return Emitting(seq, chunk, verify_request(seq, drafts, draft_probs), plan)
        except Exception as exc:  # its rows still take part in the step's one verifier call, unadjusted
            return Emitting(seq, chunk, VerifyRequest(drafts, SamplingParams()), plan, exc)

    def _verify(self, emitting: list[Emitting], logits: StepLogits[Any]) -> list[list[int] | Exception]:
        """One verifier call over every emitting sequence's rows, where the runtime left them; should it
        fail, each sequence alone, so that a failure stays with the request it comes from."""
        if not emitting:
            return []
        try:
            return list(self.verifier.verify(logits.rows, [e.request for e in emitting]))
        except Exception:
            log.warning("batched verification failed; verifying each sequence alone", exc_info=True)
        emitted: list[list[int] | Exception] = []
        for e in emitting:
            try:
                emitted.append(self.verifier.verify(logits[e.chunk], [e.request])[0])
            except Exception as exc:
                emitted.append(exc)
        return emitted

    # -- commit / rollback ------------------------------------------------------------------------

    def _commit_step(
        self,
        emitting: Emitting,
        emitted: list[int] | Exception,
        entries: list[TokenLogprobs] | Exception | None,
    ) -> EngineOutput:
        """Accepted drafts plus one target token: roll back the rejected drafts' KV, then append (with their
        logprobs when the request asked)."""
        if emitting.error is not None:
            raise emitting.error
        if isinstance(emitted, Exception):
            raise emitted
        if isinstance(entries, Exception):
            raise entries
        seq, plan = emitting.seq, emitting.plan
        if plan is None:  # the first token after the prompt
            if self.prefix_cache is not None:
                self.prefix_cache.prefilled(seq)
            return self._commit(seq, emitted, entries)
        num_drafts, num_accepted = len(emitting.request.draft_ids), len(emitted) - 1
        self.policy.observe_step(seq, num_drafts, num_accepted, self._step_timing)
        seq.stats.record(num_drafts, num_accepted, plan.drafter.name if plan.drafter else None)
        self.stats.record(num_drafts, num_accepted)
        if plan.drafter is not None:
            self.stats.record_drafter(plan.drafter.name, num_drafts, num_accepted)
        if plan.drafter is not None and (
            plan.drafter.name in self.drafters or plan.drafter is self.drafting.forced
        ):
            plan.drafter.accept(seq, num_accepted)
            self.policy.observe(seq, dataclasses.replace(plan, num_tokens=num_drafts), num_accepted)
        # Rollback: the KV holds [pending] + drafts; keep the pending token and the accepted drafts.
        self.drafting.committed(seq, emitting.chunk, seq.num_computed, 1 + num_accepted)
        seq.num_computed += 1 + num_accepted
        if num_accepted < num_drafts:
            self.target.truncate(seq.slot, seq.num_computed)
        return self._commit(seq, emitted, entries)

    def _commit(self, seq: Sequence, tokens: list[int], entries: list[TokenLogprobs] | None) -> EngineOutput:
        """Append tokens one by one, stopping exactly where plain decoding would stop. (Stop strings are
        the output processor's: it reads the text and ends the request with ``abort(id, "stop")``.)"""
        context = self.target.info.context_per_sequence
        start = None
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
            start = request_start(seq)
        if not seq.params.max_tokens:  # the prompt only (its logprobs): nothing is generated
            seq.finish("length")
            tokens = []
        new: list[int] = []
        for token in tokens:
            if (
                self.target.is_eog(token) and not seq.params.ignore_eos
            ) or token in seq.params.stop_token_ids:
                seq.finish("stop")
                break
            seq.output_ids.append(token)
            new.append(token)
            if seq.grammar is not None:
                seq.grammar.commit([token])
                if seq.grammar.is_stopped():
                    seq.finish("stop")
                    break
            if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= context:
                seq.finish("length")
                break
        self.stats.generated_tokens += len(new)
        out = EngineOutput(seq.request_id, new, None, None if entries is None else entries[: len(new)], start)
        if seq.finished:
            self._release(seq)
            out.finish_reason, out.end = seq.finish_reason, request_end(seq)
        return out

    def _release(self, seq: Sequence) -> None:
        for drafter in self.drafters.values():
            try:
                drafter.release(seq)
            except Exception:  # releasing must not fail the request; the drafter's memory is its own
                log.warning("drafter %s failed to release %s", drafter.name, seq.request_id, exc_info=True)
        if seq.status is SequenceStatus.FINISHED and seq.slot >= 0:
            if self.prefix_cache is not None:
                # Its KV stays for later requests that share a prefix, unless a failure left it unknown.
                self.prefix_cache.release(seq, reusable=seq.finish_reason != "error")
            else:
                self.target.free(seq.slot)
        self.scheduler.release(seq)
        self.stats.record_finish(seq)

    def close(self) -> None:
        for drafter in self.drafters.values():
            drafter.close()
        if self.step_log is not None:
            self.step_log.close()
        self.target.close()
