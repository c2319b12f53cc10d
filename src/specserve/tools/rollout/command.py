"""``specserve verify`` and ``specserve evaluate``: the parsed flags → a rollout check → a report on disk.

``verify`` exits 0 when the consistency check passes and 1 when it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
from typing import Any

from specserve.config import Settings
from specserve.config_sources import load_settings
from specserve.engine.builder import LoadedModels, load_models
from specserve.tools.flags import names, parse_int_list, sampling
from specserve.tools.output import progress, stamped, write_report
from specserve.tools.rollout.consistency import ConsistencyOptions, ConsistencyReport, check_in_process
from specserve.tools.rollout.reports import render_consistency, render_evaluate
from specserve.tools.workloads import ToolInputError, Workload, select_workloads


def _settings(args: argparse.Namespace) -> Settings:
    return dataclasses.replace(load_settings(args, config_file=args.config), max_running=1)


def verify(args: argparse.Namespace) -> int:
    if args.in_process == bool(args.url):
        raise ToolInputError("give either --url BASE_URL or --in-process")
    if args.seeds < 0 or args.sample_tokens < 1 or args.max_tokens < 1 or not 0 < args.alpha < 1:
        raise ToolInputError("need --seeds >= 0, --sample-tokens >= 1, --max-tokens >= 1, 0 < --alpha < 1")
    if args.seeds and args.temperature <= 0:
        raise ToolInputError("the sampled check needs --temperature > 0 (or --seeds 0)")
    sampling(max_tokens=args.max_tokens, seed=args.seed)  # what the check will ask for, checked now
    if args.seeds:
        sampling(
            temperature=args.temperature, top_k=args.top_k, max_tokens=args.sample_tokens, seed=args.seed
        )
    workloads = select_workloads(names(args.workload), args.prompts, args.limit)
    options = ConsistencyOptions(
        args.max_tokens, args.seeds, args.temperature, args.top_k, args.sample_tokens, args.alpha, args.seed
    )
    if args.in_process:
        result, meta = _verify_in_process(args, workloads, options)
    else:
        result, meta = _verify_over_http(args, workloads, options)
    report = stamped({**meta, **result.as_dict()})
    write_report(args.output_dir, report, render_consistency(report))
    progress(f"verify: {'PASS' if result.passed else 'FAIL'}")
    return 0 if result.passed else 1


def _verify_over_http(
    args: argparse.Namespace, workloads: list[Workload], options: ConsistencyOptions
) -> tuple[ConsistencyReport, dict[str, Any]]:
    from specserve.tools.loadgen.bench import spec_extension
    from specserve.tools.loadgen.client import normalize_base_url
    from specserve.tools.loadgen.command import server_options
    from specserve.tools.rollout.consistency_http import HttpCheck, check_over_http

    reference = normalize_base_url(args.reference_url) if args.reference_url else None
    check = HttpCheck(server_options(args), spec_extension(args.drafter, args.num_draft_tokens), reference)
    return asyncio.run(check_over_http(check, workloads, options, progress))


def _verify_in_process(
    args: argparse.Namespace, workloads: list[Workload], options: ConsistencyOptions
) -> tuple[ConsistencyReport, dict[str, Any]]:
    from specserve.tools.rollout.inprocess import open_reference

    settings = _settings(args)
    models = load_models(settings, keep_draft=settings.drafter in ("auto", "draft-model"))
    try:
        arms: list[str] = list(models.drafters)
        if settings.drafter in ("ngram", "suffix", "draft-model"):
            if settings.drafter not in models.drafters:
                raise ToolInputError(f"drafter {settings.drafter} is not loaded (give --draft PATH)")
            arms = [settings.drafter]
        k = max(1, min(settings.num_draft_tokens, models.max_draft_tokens))
        reference = open_reference(settings, args.reference_target) if args.reference_target else None
        try:
            if reference is not None and reference.info.vocab_size != models.target.info.vocab_size:
                raise ToolInputError("--reference-target has a different vocabulary size than the target")
            result = check_in_process(models, arms, k, workloads, options, progress, reference)
        finally:
            if reference is not None:
                reference.close()
    finally:
        models.close()
    meta: dict[str, Any] = {
        "mode": "in-process",
        "target": settings.target,
        "draft": settings.draft,
        "arms": arms,
    }
    meta |= {"num_draft_tokens": k, "exact": settings.exact, "reference_target": args.reference_target}
    return result, meta


def evaluate(args: argparse.Namespace) -> int:
    from specserve.tools.rollout.evaluate import build_report, configurations
    from specserve.tools.rollout.evaluate import evaluate as run_evaluation

    workloads = select_workloads(names(args.workload), args.prompts, args.limit)
    lengths = parse_int_list(args.draft_lengths, "--draft-lengths")
    params = sampling(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    settings = _settings(args)
    models = load_models(settings, keep_draft=True)
    try:
        calibrated = copy.deepcopy(models.costs)  # expected speed-ups come from the costs as calibrated
        drafters = names([args.drafters]) if args.drafters else list(models.drafters)
        missing = [d for d in drafters if d not in models.drafters]
        if missing:
            raise ToolInputError(
                f"drafter(s) {', '.join(missing)} not loaded; loaded: {', '.join(models.drafters)}"
            )
        configs, notes = configurations(models, drafters, lengths)
        tallies = run_evaluation(models, workloads, configs, params, progress)
        meta = _evaluate_meta(args, settings, models, notes)
        report = build_report(tallies, configs, calibrated, meta)
    finally:
        models.close()
    write_report(args.output_dir, report, render_evaluate(report))
    return 0


def _evaluate_meta(
    args: argparse.Namespace, settings: Settings, models: LoadedModels, notes: list[str]
) -> dict[str, Any]:
    return stamped(
        {
            "target": settings.target,
            "draft": settings.draft,
            "exact": settings.exact,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "notes": [*models.report.notes, *notes],
        }
    )
