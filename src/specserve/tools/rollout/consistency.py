"""The consistency check (``specserve verify``, the guides' 一致性验证): is the output with speculation the
output without it?

Greedy (temperature 0): every prompt is generated plainly and with each drafter (same seed); the outputs
must be equal token for token (in-process) or character for character (over HTTP: the OpenAI API returns
no token ids). The first divergence is reported with both continuations and, in-process, the target's logit
margin there (top-1 minus top-2 logit, recomputed by a prefill of the common prefix): a margin near zero is
a numerical near-tie, a large one is a bug.

Sampled (temperature > 0): speculation must not change the output distribution. For every prompt, the
first ``sample_tokens`` tokens are drawn over many seeds in both arms (disjoint seeds: independent samples)
and each position's token distribution is compared with a chi-square test (over HTTP: the short output
text as one category); the run fails when the Bonferroni-corrected smallest p-value is below ``alpha``.
In-process, the target's mean log-likelihood of both arms' outputs is reported alongside.

This module holds the report and the in-process check; :mod:`.consistency_http` checks a server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specserve.backends.base import ModelRuntime
from specserve.engine.builder import LoadedModels
from specserve.request import SamplingParams
from specserve.tools.rollout.inprocess import generate, next_token_logits, output_logprobs, prompt_ids
from specserve.tools.rollout.stats import bonferroni, chi_square_p_value
from specserve.tools.workloads import Workload

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ConsistencyOptions:
    """What to compare: greedy output length, and the sampled check's draws."""

    max_tokens: int = 64
    seeds: int = 40
    """Samples per arm and prompt for the sampled check (0 skips it)."""
    temperature: float = 1.0
    top_k: int = 0
    sample_tokens: int = 4
    alpha: float = 0.01
    seed: int = 0


@dataclass
class GreedyCase:
    workload: str
    prompt: int
    arm: str
    equal: bool
    compared: int
    """Tokens (in-process) or characters (HTTP) of the plain output."""
    divergence: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class SampledCase:
    workload: str
    prompt: int
    arm: str
    samples: int
    p_values: list[float]
    plain_loglik: float | None = None
    spec_loglik: float | None = None
    error: str | None = None


@dataclass
class ConsistencyReport:
    """The outcome: every greedy and sampled case, and whether the check passed."""

    unit: str
    alpha: float
    greedy: list[GreedyCase] = field(default_factory=list)
    sampled: list[SampledCase] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def sampled_p_value(self) -> float | None:
        p_values = [p for case in self.sampled for p in case.p_values]
        return bonferroni(p_values) if p_values else None

    @property
    def passed(self) -> bool:
        greedy_ok = all(c.equal and c.error is None for c in self.greedy)
        p = self.sampled_p_value
        sampled_ok = all(c.error is None for c in self.sampled) and (p is None or p >= self.alpha)
        return greedy_ok and sampled_ok

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "unit": self.unit,
            "greedy": {
                "equal": sum(c.equal for c in self.greedy),
                "total": len(self.greedy),
                "cases": [dataclasses.asdict(c) for c in self.greedy],
            },
            "sampled": {
                "alpha": self.alpha,
                "p_value": self.sampled_p_value,
                "tests": sum(len(c.p_values) for c in self.sampled),
                "cases": [dataclasses.asdict(c) for c in self.sampled],
            },
            "notes": self.notes,
        }


def first_difference(a: list[Any] | str, b: list[Any] | str) -> int | None:
    """Index of the first differing element (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# -- in-process -----------------------------------------------------------------------------------


def check_in_process(
    models: LoadedModels,
    arms: list[str],
    num_draft_tokens: int,
    workloads: list[Workload],
    options: ConsistencyOptions,
    progress: Progress,
    reference: ModelRuntime[Any] | None = None,
) -> ConsistencyReport:
    """Compare plain decoding (on ``reference`` if given) with each drafter in ``arms``."""
    plain = models
    if reference is not None:
        plain = dataclasses.replace(models, target=reference, draft=None, drafters={})
    result = ConsistencyReport("token ids", options.alpha)
    for workload in workloads:
        for i, prompt in enumerate(workload.prompts):
            ids = prompt_ids(models, prompt)
            params = SamplingParams(max_tokens=options.max_tokens, seed=options.seed)
            base = generate(plain, ids, params).output_ids
            for arm in arms:
                out = generate(models, ids, params, (arm,), num_draft_tokens).output_ids
                case = GreedyCase(workload.name, i, arm, out == base, len(base))
                at = first_difference(base, out)
                if at is not None:
                    case.divergence = _token_divergence(models, ids, base, out, at)
                result.greedy.append(case)
                progress(
                    f"[greedy] {workload.name} #{i} {arm}: {'equal' if case.equal else f'differs at {at}'}"
                )
            if options.seeds:
                cases = _sampled_in_process(models, plain, arms, num_draft_tokens, ids, options)
                for case_s in cases:
                    case_s.workload, case_s.prompt = workload.name, i
                result.sampled += cases
                progress(
                    f"[sampled] {workload.name} #{i}: min p "
                    + ", ".join(f"{c.arm} {min(c.p_values, default=1.0):.3g}" for c in cases)
                )
    return result


def _token_divergence(
    models: LoadedModels, ids: list[int], plain: list[int], spec: list[int], at: int
) -> dict[str, Any]:
    logits = next_token_logits(models.target, ids + plain[:at])
    top2 = np.sort(logits)[-2:]
    token = models.target.detokenize
    return {
        "position": at,
        "plain_token": plain[at] if at < len(plain) else None,
        "spec_token": spec[at] if at < len(spec) else None,
        "plain_continuation": token(plain[at : at + 16]),
        "spec_continuation": token(spec[at : at + 16]),
        "logit_margin": round(float(top2[1] - top2[0]), 6),
        "plain_logit": round(float(logits[plain[at]]), 6) if at < len(plain) else None,
        "spec_logit": round(float(logits[spec[at]]), 6) if at < len(spec) else None,
    }


def _sampled_in_process(
    models: LoadedModels,
    plain: LoadedModels,
    arms: list[str],
    k: int,
    ids: list[int],
    options: ConsistencyOptions,
) -> list[SampledCase]:
    def sample(m: LoadedModels, drafters: tuple[str, ...], seed: int) -> list[int]:
        params = SamplingParams(
            temperature=options.temperature,
            top_k=options.top_k,
            seed=seed,
            max_tokens=options.sample_tokens,
        )
        return generate(m, ids, params, drafters, k if drafters else 0).output_ids

    n, first = options.seeds, options.seed
    base = [sample(plain, (), first + s) for s in range(n)]
    base_ll = _mean_loglik(models.target, ids, base)
    cases = []
    for arm in arms:
        outs = [sample(models, (arm,), first + n + s) for s in range(n)]
        p_values = [chi_square_p_value(_at(base, j), _at(outs, j))[0] for j in range(options.sample_tokens)]
        ll = _mean_loglik(models.target, ids, outs)
        cases.append(SampledCase("", 0, arm, n, p_values, base_ll, ll))
    return cases


def _at(outputs: list[list[int]], j: int) -> list[int]:
    return [out[j] if j < len(out) else -1 for out in outputs]  # -1: the output ended before j


def _mean_loglik(runtime: ModelRuntime[Any], ids: list[int], outputs: list[list[int]]) -> float | None:
    scores = np.concatenate(output_logprobs(runtime, ids, outputs))
    return round(float(scores.mean()), 6) if scores.size else None
