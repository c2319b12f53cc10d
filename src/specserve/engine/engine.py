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
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from specserve.backends.base import DecodeChunk, ModelRuntime
from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import DraftLengthPolicy, DraftPlan
from specserve.engine.output_text import OutputText
from specserve.engine.prefix_cache import PrefixCache
from specserve.engine.scheduler import Scheduler
from specserve.engine.stats import EngineStats
from specserve.request import ACCEPT_STREAM, SAMPLE_STREAM, PositionalUniforms, SamplingParams
from specserve.sequence import Sequence, SequenceStatus, SpeculationOptions
from specserve.verify import filter_logits_to_probs, verify_greedy, verify_rejection

log = logging.getLogger("specserve.engine")

MAX_DRAFTER_FAILURES = 3


@dataclass(frozen=True)
class EngineOptions:
    """Engine-wide speculation defaults (per-request options override them)."""

    drafters: tuple[str, ...] = ("ngram",)
    """Drafters the policy may choose from when a request does not name one (``auto``)."""
    num_draft_tokens: int = 16
    """Upper bound on draft tokens per step."""
    speculation_enabled: bool = True
    """Server-wide switch: False runs every request as plain decoding."""


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    seq: Sequence
    new_token_ids: list[int]
    text_delta: str
    finished: bool

    @property
    def request_id(self) -> str:
        return self.seq.request_id


class SpeculativeEngine:
    """Runs many sequences at once on one target runtime with pluggable drafters."""

    def __init__(
        self,
        target: ModelRuntime,
        drafters: Mapping[str, Drafter],
        policy: DraftLengthPolicy,
        costs: CostModel,
        options: EngineOptions = EngineOptions(),
        prefill_budget: int = 256,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.target = target
        self.drafters = dict(drafters)
        self.policy = policy
        self.costs = costs
        self.options = options
        self.prefix_cache = prefix_cache
        admit = prefix_cache.admit if prefix_cache is not None else None
        self.scheduler = Scheduler(target.info.max_sequences, prefill_budget, admit)
        self.stats = EngineStats()
        self._texts: dict[str, OutputText] = {}
        self._failures: dict[str, int] = {}

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
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, list(prompt_ids), params, PositionalUniforms(seed))
        seq.speculation = speculation or SpeculationOptions()
        seq.cache_salt = cache_salt
        name = seq.speculation.drafter
        if name is not None and name not in self.drafters and name not in ("none", "auto"):
            raise ValueError(
                f"drafter {name!r} is not available; loaded: {', '.join(self.drafters) or 'none'}"
            )
        self._texts[request_id] = OutputText(self.target.token_bytes, params.stop)
        for drafter in self.drafters.values():
            drafter.begin(seq)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV memory; returns whether it was known."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        seq.finish("abort")
        self._release(seq)
        return True

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

    def kv_usage(self) -> float:
        """Tokens the running sequences hold, as a share of the KV cache, in [0, 1]."""
        capacity = self.target.info.context_per_sequence * self.scheduler.max_running
        used = sum(seq.num_tokens for seq in list(self.scheduler.running))
        return min(1.0, used / capacity) if capacity else 0.0

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.empty:
            return []
        plans = self._plan(batch.decodes, [n for _, n in batch.prefills])
        proposals = self._draft(batch.decodes, plans)
        logits = self._evaluate(batch.prefills, batch.decodes, proposals)
        prefill_logits, decode_logits = logits[: len(batch.prefills)], logits[len(batch.prefills) :]
        outputs = [
            self._isolated(seq, self._first_token, seq, rows)
            for (seq, _), rows in zip(batch.prefills, prefill_logits, strict=True)
        ]
        for seq, plan, proposal, rows in zip(batch.decodes, plans, proposals, decode_logits, strict=True):
            outputs.append(self._isolated(seq, self._verify_and_commit, seq, plan, proposal, rows))
        return [o for o in outputs if o is not None]

    def _isolated(
        self, seq: Sequence, fn: Callable[..., RequestOutput | None], *args: object
    ) -> RequestOutput | None:
        """Verify and commit one sequence; if that raises, only this request fails (finish reason
        ``error``, its KV freed) and the step goes on for the others."""
        try:
            return fn(*args)
        except Exception:
            log.exception("request %s failed in the engine; the other requests continue", seq.request_id)
            if not seq.finished:
                seq.finish("error")
            self._release(seq)
            return RequestOutput(seq, [], "", True)

    def _plan(self, seqs: list[Sequence], prefill_rows: list[int]) -> list[DraftPlan]:
        """Ask each allowed drafter what it could offer, then let the policy decide (0 tokens = plain)."""
        options: list[dict[str, tuple[Drafter, DraftOption]]] = []
        for seq in seqs:
            allowed: dict[str, tuple[Drafter, DraftOption]] = {}
            limit = self._draft_limit(seq)
            for name in self._allowed_drafters(seq) if limit > 0 else ():
                drafter = self.drafters[name]
                allowed[name] = (drafter, drafter.available(seq, limit))
            options.append(allowed)
        if not any(options):
            return [DraftPlan() for _ in seqs]
        return self.policy.plan(seqs, options, prefill_rows)

    def _allowed_drafters(self, seq: Sequence) -> tuple[str, ...]:
        spec = seq.speculation
        if not self.options.speculation_enabled or spec.enabled is False or spec.drafter == "none":
            return ()
        names = self.options.drafters if spec.drafter in (None, "auto") else (spec.drafter,)
        return tuple(n for n in names if n in self.drafters)

    def _draft_limit(self, seq: Sequence) -> int:
        """Draft tokens allowed for seq: the configured bound, and room left in its context."""
        bound = seq.speculation.num_draft_tokens
        bound = self.options.num_draft_tokens if bound is None else bound
        room = self.target.info.context_per_sequence - seq.num_tokens
        left = seq.params.max_tokens - len(seq.output_ids) - 1  # the verify step emits one more itself
        exact_cap = self.target.info.max_verify_tokens - 1
        return max(0, min(bound, room, left, exact_cap))

    def _draft(self, seqs: list[Sequence], plans: list[DraftPlan]) -> list[Proposal]:
        """Run each chosen drafter once over all its sequences; a failing drafter means plain steps."""
        proposals = [Proposal([]) for _ in seqs]
        by_drafter: dict[str, list[int]] = {}
        for i, plan in enumerate(plans):
            if plan.drafter is not None and plan.num_tokens > 0:
                by_drafter.setdefault(plan.drafter.name, []).append(i)
        for name, idx in by_drafter.items():
            drafter = self.drafters[name]
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

    def _drafter_failed(self, name: str, seqs: list[Sequence], exc: BaseException) -> None:
        self._failures[name] = self._failures.get(name, 0) + 1
        self.stats.drafter_failures += 1
        log.warning("drafter %s failed (%s); %d requests continue without it", name, exc, len(seqs))
        drafter = self.drafters[name]
        for seq in seqs:
            try:
                drafter.release(seq)
                drafter.begin(seq)
            except Exception:  # the drafter is already broken; its state is dropped with it
                log.debug("drafter %s could not reset its state", name, exc_info=True)
        if self._failures[name] >= MAX_DRAFTER_FAILURES:
            log.error("drafter %s disabled after %d failures", name, self._failures[name])
            self.drafters.pop(name, None)

    def _evaluate(
        self, prefills: list[tuple[Sequence, int]], decodes: list[Sequence], proposals: list[Proposal]
    ) -> list[npt.NDArray[np.float32]]:
        """One target pass over prompt chunks and verify batches ([pending] + draft tokens) together."""
        chunks = []
        for seq, n in prefills:
            pos = seq.num_computed
            last = pos + n == len(seq.prompt_ids)
            chunks.append(DecodeChunk(seq.slot, seq.prompt_ids[pos : pos + n], pos, 1 if last else 0))
        for seq, proposal in zip(decodes, proposals, strict=True):
            verify = [seq.tokens[-1], *proposal.token_ids]
            chunks.append(DecodeChunk(seq.slot, verify, seq.num_computed, len(verify)))
        n_tokens = sum(len(c.tokens) for c in chunks)
        start = time.perf_counter()
        logits = self.target.decode(chunks)
        elapsed = time.perf_counter() - start
        if not prefills:
            self.costs.target.observe(n_tokens, elapsed)
        self.stats.verify_seconds += elapsed
        for seq in decodes:
            seq.verify_seconds += elapsed / len(decodes)
        for seq, n in prefills:
            seq.num_computed += n
        return logits

    # -- commit / rollback ------------------------------------------------------------------------

    def _first_token(self, seq: Sequence, rows: npt.NDArray[np.float32]) -> RequestOutput | None:
        """After the last prompt chunk, the target's logits give the first output token."""
        if rows.shape[0] == 0:
            return None  # more prompt chunks to come
        seq.prefill_done_time = time.perf_counter()
        if self.prefix_cache is not None:
            self.prefix_cache.prefilled(seq)
        result = self._verify(seq, [], None, rows)
        return self._commit(seq, result)

    def _verify_and_commit(
        self, seq: Sequence, plan: DraftPlan, proposal: Proposal, rows: npt.NDArray[np.float32]
    ) -> RequestOutput:
        drafts = proposal.token_ids
        result = self._verify(seq, drafts, proposal.draft_probs, rows)
        num_accepted = len(result) - 1
        seq.stats.record(len(drafts), num_accepted, plan.drafter.name if plan.drafter else None)
        self.stats.record(len(drafts), num_accepted)
        if plan.drafter is not None and plan.drafter.name in self.drafters:
            plan.drafter.accept(seq, num_accepted)
            self.policy.observe(seq, dataclasses.replace(plan, num_tokens=len(drafts)), num_accepted)
        # Rollback: the KV holds [pending] + drafts; keep the pending token and the accepted drafts.
        seq.num_computed += 1 + num_accepted
        if num_accepted < len(drafts):
            self.target.truncate(seq.slot, seq.num_computed)
        return self._commit(seq, result)

    def _verify(
        self,
        seq: Sequence,
        drafts: list[int],
        draft_probs: npt.NDArray[np.float64] | None,
        rows: npt.NDArray[np.float32],  # [len(drafts) + 1, vocab]
    ) -> list[int]:
        """Tokens this step emits: accepted drafts plus one recovered or bonus token from the target."""
        k = len(drafts)
        draft_ids = np.array([drafts], dtype=np.int64).reshape(1, k)
        num_draft = np.array([k], dtype=np.int64)
        if seq.params.greedy:
            result = verify_greedy(draft_ids, num_draft, rows[None])
        else:
            p = seq.params
            target_probs = filter_logits_to_probs(rows, p.temperature, p.top_k, p.top_p, p.min_p)
            position = len(seq.output_ids)
            result = verify_rejection(
                draft_ids,
                num_draft,
                target_probs[None],
                None if draft_probs is None else draft_probs[None],
                seq.uniforms.take(ACCEPT_STREAM, position, k)[None],
                seq.uniforms.take(SAMPLE_STREAM, position, k + 1)[None],
            )
        return result.tokens(0)

    def _commit(self, seq: Sequence, tokens: list[int]) -> RequestOutput:
        """Append tokens one by one, stopping exactly where plain decoding would stop."""
        text = self._texts[seq.request_id]
        context = self.target.info.context_per_sequence
        new: list[int] = []
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        for token in tokens:
            if self.target.is_eog(token) and not seq.params.ignore_eos:
                seq.finish("stop")
                break
            seq.output_ids.append(token)
            new.append(token)
            if text.append(token):
                seq.finish("stop")
            elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= context:
                seq.finish("length")
            if seq.finished:
                break
        self.stats.generated_tokens += len(new)
        seq.text = text.text
        if seq.finished:
            text.finish()
            self._release(seq)
        return RequestOutput(seq, new, text.take_delta(final=seq.finished), seq.finished)

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
        self._texts.pop(seq.request_id, None)
        self.stats.record_finish(seq)

    def close(self) -> None:
        for drafter in self.drafters.values():
            drafter.close()
        self.target.close()
