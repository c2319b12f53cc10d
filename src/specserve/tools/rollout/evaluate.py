"""``specserve evaluate``: which drafter and draft length pay on these prompts, measured without a server.

For every workload, each prompt is generated plainly and with every configuration — a drafter with a fixed
draft length (``FixedLengthPolicy``: draft as much as allowed every step), and ``auto`` (the cost-aware
policy over all loaded drafters, the server's default). Every verify step is recorded (drafter, tokens
drafted, tokens accepted), which gives the acceptance rate, the mean acceptance length (1 + accepted /
drafts) and the acceptance per draft position (accepted / drafts that reached the position).

Expected speed-up, from the engine's cost model as calibrated at load (``CostModel``)::

    plain    = decode_tokens × target(1)
    spec     = Σ over drafting steps [target(k + 1) + k × draft(1) for the draft model]
             + plain_steps × target(1)               (steps where the drafter had nothing to offer)
    speed-up = plain / spec

(``k × draft(1)``: one catch-up call and k - 1 chain steps, as ``draft_model_can_pay`` counts them.)
The measured wall-clock speed-up is reported too, but on a shared machine it is noisy; the recommendation
uses the expected one: the best configuration, or plain decoding when nothing beats it by ``MARGIN``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from specserve.config import PolicyChoice
from specserve.drafters.base import Drafter, DraftOption
from specserve.engine.builder import DEFAULT_MARGIN, LoadedModels
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import DraftLengthPolicy, DraftPlan
from specserve.engine.output_processor import RequestState
from specserve.request import SamplingParams
from specserve.sequence import Sequence
from specserve.tools.rollout.inprocess import generate, prompt_ids
from specserve.tools.workloads import Workload

MARGIN = DEFAULT_MARGIN  # as the server's policy: leaving plain decoding needs a clear win

Progress = Callable[[str], None]


class RecordingPolicy(DraftLengthPolicy):
    """Wraps a policy and records every verify step: (drafter name, tokens drafted, tokens accepted)."""

    def __init__(self, inner: DraftLengthPolicy) -> None:
        self.inner = inner
        self.steps: list[tuple[str, int, int]] = []

    def plan(
        self,
        seqs: Seq[Sequence],
        options: Seq[Mapping[str, tuple[Drafter, DraftOption]]],
        prefill_rows: Seq[int] = (),
        prefill_slots: Seq[int] | None = None,
    ) -> list[DraftPlan]:
        return self.inner.plan(seqs, options, prefill_rows, prefill_slots)

    def observe(self, seq: Sequence, plan: DraftPlan, num_accepted: int) -> None:
        if plan.drafter is not None and plan.num_tokens > 0:
            self.steps.append((plan.drafter.name, plan.num_tokens, num_accepted))
        self.inner.observe(seq, plan, num_accepted)


@dataclass(frozen=True)
class Config:
    label: str
    drafters: tuple[str, ...]
    num_draft_tokens: int
    policy: PolicyChoice

    def flags(self) -> str:
        if not self.drafters:
            return "--drafter none"
        if self.policy == "cost":
            return "--drafter auto --draft-policy cost"
        return f"--drafter {self.drafters[0]} --num-draft-tokens {self.num_draft_tokens} --draft-policy fixed"


@dataclass
class Tally:
    """One configuration's totals over the prompts of a workload."""

    decode_tokens: int = 0
    seconds: float = 0.0
    steps: list[tuple[str, int, int]] = field(default_factory=list)

    def add(self, seq: RequestState, steps: list[tuple[str, int, int]]) -> None:
        assert seq.first_token_time is not None and seq.finish_time is not None
        self.decode_tokens += max(len(seq.output_ids) - 1, 0)
        self.seconds += seq.finish_time - seq.first_token_time
        self.steps += steps

    def expected_seconds(self, costs: CostModel) -> float:
        """Decode time the cost model predicts for these steps (module docstring)."""
        target, draft = costs.target, costs.draft
        seconds = 0.0
        emitted = 0
        for name, k, accepted in self.steps:
            seconds += target(k + 1)
            if name == "draft-model" and draft is not None:
                seconds += k * draft(1)
            emitted += 1 + accepted
        return seconds + max(self.decode_tokens - emitted, 0) * target(1)

    def summary(self, costs: CostModel, plain: Tally) -> dict[str, Any]:
        drafts = len(self.steps)
        drafted = sum(k for _, k, _ in self.steps)
        accepted = sum(a for _, _, a in self.steps)
        longest = max((k for _, k, _ in self.steps), default=0)
        offered = [sum(k > pos for _, k, _ in self.steps) for pos in range(longest)]
        hits = [sum(a > pos for _, _, a in self.steps) for pos in range(longest)]
        expected = self.expected_seconds(costs)
        speed, plain_speed = self.tokens_per_second, plain.tokens_per_second
        return {
            "decode_tokens": self.decode_tokens,
            "num_drafts": drafts,
            "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
            "accepted_per_position": hits,
            "acceptance_by_position": [round(h / o, 4) for h, o in zip(hits, offered, strict=True)],
            "expected_speedup": round(self.decode_tokens * costs.target(1) / expected, 4)
            if expected
            else None,
            "tokens_per_second": round(speed, 3),
            "measured_speedup": round(speed / plain_speed, 4) if plain_speed else None,
        }

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.seconds if self.seconds > 0 else 0.0


def configurations(
    models: LoadedModels, drafters: list[str], lengths: list[int]
) -> tuple[list[Config], list[str]]:
    """Plain, each drafter × each length (capped by the engine), and auto; plus notes on what changed."""
    notes = []
    cap = models.max_draft_tokens
    capped = sorted({min(k, cap) for k in lengths})
    if max(lengths) > cap:
        notes.append(
            f"draft lengths above {cap} run as {cap}: exact mode caps a verify pass at "
            f"{cap + 1} tokens (RuntimeInfo.max_verify_tokens)"
        )
    configs = [Config("plain", (), 0, "fixed")]
    for name in drafters:
        configs += [Config(f"{name} k={k}", (name,), k, "fixed") for k in capped]
    configs.append(Config("auto", tuple(drafters), cap, "cost"))
    return configs, notes


def evaluate(
    models: LoadedModels,
    workloads: list[Workload],
    configs: list[Config],
    params: SamplingParams,
    progress: Progress,
) -> dict[str, dict[str, Tally]]:
    """workload → config label → tally, every prompt run once per configuration (interleaved)."""
    tallies: dict[str, dict[str, Tally]] = {}
    for workload in workloads:
        cells = tallies.setdefault(workload.name, {c.label: Tally() for c in configs})
        for i, prompt in enumerate(workload.prompts):
            ids = prompt_ids(models, prompt)
            for config in configs:
                policy = RecordingPolicy(models.policy(config.policy, MARGIN))
                seq = generate(models, ids, params, config.drafters, config.num_draft_tokens, policy)
                cells[config.label].add(seq, policy.steps)
            progress(f"[{workload.name}] prompt {i + 1}/{len(workload.prompts)}: {len(configs)} configs run")
    return tallies


def recommend(rows: dict[str, dict[str, Any]], configs: list[Config]) -> dict[str, Any]:
    """The configuration with the best expected speed-up, or plain decoding when none beats it clearly."""
    by_label = {c.label: c for c in configs}
    best_label, best = "plain", 1.0
    for label, row in rows.items():
        speedup = row["expected_speedup"] or 0.0
        if label != "plain" and speedup > best:
            best_label, best = label, speedup
    if best < 1.0 + MARGIN:
        best_label = "plain"
    config = by_label[best_label]
    drafter = "auto" if config.policy == "cost" else (config.drafters[0] if config.drafters else None)
    return {
        "config": best_label,
        "drafter": drafter,
        "num_draft_tokens": config.num_draft_tokens or None,
        "expected_speedup": rows[best_label]["expected_speedup"] if best_label != "plain" else 1.0,
        "flags": config.flags(),
    }


def build_report(
    tallies: dict[str, dict[str, Tally]], configs: list[Config], costs: CostModel, meta: dict[str, Any]
) -> dict[str, Any]:
    workloads = {}
    overall: dict[str, Tally] = {c.label: Tally() for c in configs}
    for name, cells in tallies.items():
        rows = {label: tally.summary(costs, cells["plain"]) for label, tally in cells.items()}
        workloads[name] = {"configs": rows, "recommendation": recommend(rows, configs)}
        for label, tally in cells.items():
            overall[label].decode_tokens += tally.decode_tokens
            overall[label].seconds += tally.seconds
            overall[label].steps += tally.steps
    overall_rows = {label: t.summary(costs, overall["plain"]) for label, t in overall.items()}
    return {
        **meta,
        "configurations": [dataclasses.asdict(c) for c in configs],
        "costs_ms": costs.as_dict(),
        "workloads": workloads,
        "overall": {"configs": overall_rows, "recommendation": recommend(overall_rows, configs)},
    }
