"""The GPU check's oracle: the real engine end to end with a drafter whose acceptance rate is chosen.

Why an oracle: random weights make every real drafter useless (nothing to predict), yet what the engine
gains on a GPU depends on acceptance, verify cost and its own per-step overhead. :class:`OracleDrafter`
replays the target's own greedy continuation, precomputed by a plain run of the same prompt, and replaces
each draft token by a wrong one with probability ``1 - alpha`` (seeded), so acceptance lengths follow
``alpha`` exactly as a geometric model says, and speculative tokens/s can be set against plain decoding in
the same run. Greedy speculative output must equal the plain output token for token; where it does not (a
fast mode, whose verify rows may round differently from one-token steps), the drafter notices the
divergence and stops drafting, and the report says where the outputs first differ.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_check_timing import context_tokens, warm_shapes
from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.engine.builder import flat_costs
from specserve.engine.cost_model import CostModel, StepCostTable, calibrate
from specserve.engine.cost_policy import CostAwarePolicy
from specserve.engine.draft_policy import (
    DraftLengthPolicy,
    FixedLengthPolicy,
    expected_tokens,
)
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.request import SamplingParams
from specserve.sequence import Sequence

COST_POLICY_MARGIN = 0.03
"""The cost policy's margin over plain decoding, as the server uses it (builder.DEFAULT_MARGIN; the builder
itself is not imported: it pulls in the settings and their dependencies, absent on the device machine)."""


class OracleDrafter(Drafter):
    """Proposes the reference continuation, each token wrong with probability ``1 - alpha``."""

    name = "oracle"

    def __init__(self, reference: Seq[int], alpha: float, vocab_size: int, seed: int = 0) -> None:
        self.reference = list(reference)
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self.diverged_at: int | None = None
        """Output position where the sequence left the reference (then the drafter offers nothing)."""

    def begin(self, seq: Sequence) -> None:
        seq.drafter_state[self.name] = 0

    def _on_reference(self, seq: Sequence) -> bool:
        """Whether every output token so far is the reference's (checked incrementally)."""
        if self.diverged_at is not None:
            return False
        checked = seq.drafter_state.get(self.name, 0)
        assert isinstance(checked, int)
        out = seq.output_ids
        for i in range(checked, len(out)):
            if i >= len(self.reference) or out[i] != self.reference[i]:
                self.diverged_at = i
                return False
        seq.drafter_state[self.name] = len(out)
        return True

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        if limit <= 0 or not self._on_reference(seq):
            return DraftOption(0)
        return DraftOption(max(0, min(limit, len(self.reference) - len(seq.output_ids))), "oracle")

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        proposals = []
        for seq, k in zip(seqs, num_tokens, strict=True):
            pos = len(seq.output_ids)
            true = self.reference[pos : pos + k]
            keep = self.rng.random(len(true)) < self.alpha
            shift = self.rng.integers(1, self.vocab_size, len(true))  # never 0: a wrong token is wrong
            proposals.append(
                Proposal(
                    [
                        t if ok else int((t + s) % self.vocab_size)
                        for t, ok, s in zip(true, keep, shift, strict=True)
                    ]
                )
            )
        return proposals

    def release(self, seq: Sequence) -> None:
        seq.drafter_state.pop(self.name, None)


@dataclass(frozen=True)
class Run:
    """One generation: its tokens and its decode-phase speed (the first token, after the prompt, excluded)."""

    output: list[int]
    tokens_per_s: float
    mean_acceptance_length: float
    acceptance_rate: float


def generate(
    runtime: Any,
    prompt: list[int],
    max_tokens: int,
    drafter: Drafter | None = None,
    policy: DraftLengthPolicy | None = None,
    costs: CostModel | None = None,
    num_draft_tokens: int = 8,
) -> Run:
    """One greedy request through a fresh :class:`SpeculativeEngine` over ``runtime`` (plain without a
    drafter)."""
    engine = _engine(runtime, drafter, policy, costs, num_draft_tokens)
    seq = engine.add_request(
        "gpu-check", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=0)
    )
    while engine.has_work():
        engine.step()
    assert seq.first_token_time is not None and seq.finish_time is not None
    seconds = seq.finish_time - seq.first_token_time
    stats = seq.stats
    return Run(
        output=list(seq.output_ids),
        tokens_per_s=(len(seq.output_ids) - 1) / seconds if seconds > 0 else 0.0,
        mean_acceptance_length=stats.mean_acceptance_length if stats.num_drafts else 1.0,
        acceptance_rate=stats.acceptance_rate if stats.num_draft_tokens else 0.0,
    )


def _engine(
    runtime: Any,
    drafter: Drafter | None,
    policy: DraftLengthPolicy | None,
    costs: CostModel | None,
    num_draft_tokens: int,
) -> SpeculativeEngine:
    drafters = {} if drafter is None else {drafter.name: drafter}
    options = EngineOptions(tuple(drafters), num_draft_tokens, speculation_enabled=bool(drafters))
    policy = policy or FixedLengthPolicy()
    return SpeculativeEngine(runtime, drafters, policy, costs or CostModel(flat_costs()), options)


def host_waits(
    runtime: Any, prompt: list[int], reference: Seq[int], k: int, tokens: int = 32
) -> dict[str, Any]:
    """Synchronizing CUDA calls per engine step, as torch's sync debug mode reports them (a warning each),
    plain and with oracle drafts at α = 0.8 (greedy and sampled): the aim is one, the verifier's read.
    The lines that made them are kept, most frequent first."""
    out: dict[str, Any] = {}
    vocab = runtime.config.vocab_size
    for label, temperature, drafter in (
        ("plain", 0.0, None),
        ("drafts", 0.0, OracleDrafter(reference, 0.8, vocab, seed=7)),
        ("drafts, sampled", 0.8, OracleDrafter(reference, 0.8, vocab, seed=8)),
    ):
        engine = _engine(runtime, drafter, None, None, k)
        engine.add_request(
            "waits",
            prompt,
            SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=temperature, seed=0),
        )
        steps = 0
        debug = runtime.device.type == "cuda"  # on a CPU: the loop runs, and nothing can wait
        if debug:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                while engine.has_work():
                    engine.step()
                    steps += 1
        finally:
            if debug:
                torch.cuda.set_sync_debug_mode("default")
        waits = [w for w in caught if "synchroniz" in str(w.message)]
        where = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in waits)
        out[label] = {
            "steps": steps,
            "waits_per_step": round(len(waits) / max(1, steps), 2),
            "where": dict(where.most_common(6)),
        }
    return out


def first_difference(a: Seq[int], b: Seq[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def oracle_runs(
    runtime: Any,
    *,
    prompt_tokens: int,
    max_tokens: int,
    alphas: Seq[float],
    num_draft_tokens: int,
    deadline: float,
) -> dict[str, Any]:
    """Plain, then fixed-length and cost-policy speculation at each ``alpha``, then plain again, on one
    runtime; speed-ups against the mean of the two plain runs. Stops early (noted) past ``deadline``."""
    vocab = runtime.config.vocab_size
    prompt = context_tokens(vocab, prompt_tokens, seed=2)
    k = num_draft_tokens
    graphs = warm_shapes(runtime, sorted({1, 2, 4, 8, 16, k + 1}), prompt_tokens + max_tokens + k + 1)
    table = calibrate(runtime, 0)

    def costs() -> CostModel:  # a copy per run: the engine refines the table it is given
        return CostModel(StepCostTable(table.seconds.copy()))

    plain = generate(runtime, prompt, max_tokens)
    reference = plain.output
    result: dict[str, Any] = {
        "exactness": runtime.info.exactness,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "num_draft_tokens": k,
        "graphs_warmed": graphs,
        "graphs_failed": None if runtime.graphs is None else runtime.graphs.failed,
        "distinct_fraction": round(len(set(reference)) / len(reference), 3),
        "calibrated_ms": {n: round(table(n) * 1000, 3) for n in (1, 2, 4, 8, k + 1, 16)},
        "runs": [],
    }
    plain_rates = [plain.tokens_per_s]
    for policy_name, alpha in [(p, a) for p in ("fixed", "cost") for a in alphas]:
        if result["runs"] and time.perf_counter() > deadline:  # one run at least: is it identical?
            result["note"] = "budget exhausted: the remaining (policy, alpha) runs were skipped"
            break
        drafter = OracleDrafter(reference, alpha, vocab, seed=int(alpha * 1000))
        fixed = policy_name == "fixed"
        run_costs = costs()
        policy: DraftLengthPolicy = (
            FixedLengthPolicy()
            if fixed
            else CostAwarePolicy(run_costs, COST_POLICY_MARGIN, runtime.call_rows)
        )
        spec = generate(runtime, prompt, max_tokens, drafter, policy, run_costs, k)
        mismatch = first_difference(spec.output, reference)
        result["runs"].append(
            {
                "policy": policy_name,
                "alpha": alpha,
                "tokens_per_s": round(spec.tokens_per_s, 3),
                "mean_acceptance_length": round(spec.mean_acceptance_length, 3),
                "expected_acceptance_length": round(expected_tokens(alpha, k), 3),
                "acceptance_rate": round(spec.acceptance_rate, 4),
                "identical": mismatch is None,
                "first_mismatch": mismatch,
                "left_reference_at": drafter.diverged_at,
                # fixed k: what the measured acceptance and the calibrated verify cost allow with no
                # engine overhead (measured / ideal: the engine's efficiency)
                "ideal_speedup": round(spec.mean_acceptance_length * table(1) / table(k + 1), 3)
                if fixed
                else None,
            }
        )
    if runtime.device.type == "cuda":
        result["host_waits"] = host_waits(runtime, prompt, reference, k)
    again = generate(runtime, prompt, max_tokens)
    plain_rates.append(again.tokens_per_s)
    plain_rate = sum(plain_rates) / len(plain_rates)
    result["plain_tokens_per_s"] = round(plain_rate, 3)
    result["plain_repeatable"] = again.output == reference
    for run in result["runs"]:
        run["speedup"] = round(run["tokens_per_s"] / plain_rate, 3) if plain_rate else 0.0
    return result
