"""The consistency check over HTTP (``specserve verify --url``): a specserve server with and without
speculation (or against a reference server), compared as text — the OpenAI API returns no token ids.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from specserve.tools.loadgen.client import BenchClient, RequestParams, RequestResult, ServerOptions, Target
from specserve.tools.rollout.consistency import (
    ConsistencyOptions,
    ConsistencyReport,
    GreedyCase,
    Progress,
    SampledCase,
    first_difference,
)
from specserve.tools.rollout.stats import chi_square_p_value
from specserve.tools.workloads import ToolInputError, Workload

SNIPPET = 60


@dataclass(frozen=True)
class HttpCheck:
    """Which servers to compare: ``server`` with ``extension`` (the speculative arm) against ``server`` with
    speculation off, or against ``reference_url`` when given."""

    server: ServerOptions
    extension: dict[str, Any]
    reference_url: str | None = None


async def check_over_http(
    check: HttpCheck, workloads: list[Workload], options: ConsistencyOptions, progress: Progress
) -> tuple[ConsistencyReport, dict[str, Any]]:
    """The report, and what was compared (for the report's header)."""
    base = check.server.base_url
    client = BenchClient(check.server.api_key, check.server.timeout, 8)
    try:
        model = check.server.model or await client.served_model(base)
        if not await client.reports_speculative(base, model):
            raise ToolInputError(
                f"{base} reports no `speculative` object: verify --url needs a specserve server"
            )
        spec = Target("speculative", base, model, check.extension)
        plain = Target("plain", base, model, {"enabled": False})
        if check.reference_url:
            plain = Target("reference", check.reference_url, await client.served_model(check.reference_url))
        result = await _check(client, spec, plain, workloads, options, progress)
    finally:
        await client.aclose()
    meta = {
        "mode": "http",
        "url": base,
        "model": model,
        "speculative_extension": spec.extension,
        "reference_url": check.reference_url,
    }
    return result, meta


async def _check(
    client: BenchClient,
    spec: Target,
    plain: Target,
    workloads: list[Workload],
    options: ConsistencyOptions,
    progress: Progress,
) -> ConsistencyReport:
    result = ConsistencyReport("text", options.alpha)
    result.notes.append("over HTTP outputs are compared as text (the OpenAI API returns no token ids)")
    greedy = RequestParams(max_tokens=options.max_tokens, temperature=0.0, seed=options.seed)
    same_server = plain.base_url == spec.base_url
    if same_server:
        result.notes.append(
            "plain requests carry a fresh cache_salt (nothing reused); each speculative request is sent "
            "twice, the second starting from the first one's cached KV (`… + prefix cache`)"
        )
    for workload in workloads:
        for i, prompt in enumerate(workload.prompts):
            cold = {"cache_salt": uuid.uuid4().hex} if same_server else None
            a = await client.chat(plain, prompt, greedy, cold)
            runs = [(spec.mode, await client.chat(spec, prompt, greedy))]
            if same_server:
                runs.append((f"{spec.mode} + prefix cache", await client.chat(spec, prompt, greedy)))
            for mode, b in runs:
                case = GreedyCase(
                    workload.name, i, mode, a.text == b.text, len(a.text), error=a.error or b.error
                )
                at = first_difference(a.text, b.text)
                if at is not None:
                    case.divergence = {
                        "position": at,
                        "plain_continuation": a.text[at : at + SNIPPET],
                        "spec_continuation": b.text[at : at + SNIPPET],
                    }
                result.greedy.append(case)
                outcome = "equal" if case.equal else f"differs at char {at}"
                progress(f"[greedy] {workload.name} #{i} {mode}: {outcome}")
            if options.seeds:
                case_s = await _sampled_http(client, spec, plain, prompt, options)
                case_s.workload, case_s.prompt = workload.name, i
                result.sampled.append(case_s)
                progress(f"[sampled] {workload.name} #{i}: p {min(case_s.p_values, default=1.0):.3g}")
    return result


async def _sampled_http(
    client: BenchClient, spec: Target, plain: Target, prompt: str, options: ConsistencyOptions
) -> SampledCase:
    gate = asyncio.Semaphore(4)

    async def one(target: Target, seed: int) -> RequestResult:
        params = RequestParams(
            max_tokens=options.sample_tokens,
            temperature=options.temperature,
            seed=seed,
            top_k=options.top_k or None,
        )
        async with gate:
            return await client.chat(target, prompt, params)

    n, first = options.seeds, options.seed
    plain_runs = await asyncio.gather(*(one(plain, first + s) for s in range(n)))
    spec_runs = await asyncio.gather(*(one(spec, first + n + s) for s in range(n)))
    errors = [r.error for r in [*plain_runs, *spec_runs] if r.error]
    p, _ = chi_square_p_value([r.text for r in plain_runs], [r.text for r in spec_runs])
    return SampledCase("", 0, spec.mode, n, [p], error=errors[0] if errors else None)
