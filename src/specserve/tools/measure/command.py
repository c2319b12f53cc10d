"""``specserve bench --in-process``: the parsed flags → one engine measurement → a report on disk.

Three measurements, chosen by flag: the engine benchmark (plain vs drafters vs the default policy, the
default), ``--exact-cost`` (exact vs fast mode per call size) and ``--vs-llama-bench`` (plain decoding vs
llama.cpp's own ``llama-bench``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

from specserve.config import Settings
from specserve.config_sources import load_settings
from specserve.tools.flags import sampling
from specserve.tools.measure.engine_bench import MODES, builtin_prompts, mode, resolve_model, run_engine_bench
from specserve.tools.measure.engine_report import render_exact_cost, render_markdown
from specserve.tools.output import command_line, progress, write_report
from specserve.tools.workloads import ToolInputError, builtin_rows, read_jsonl


def measure_in_process(args: argparse.Namespace) -> int:
    settings = dataclasses.replace(load_settings(args, config_file=args.config), max_running=1)
    threads = settings.threads or os.cpu_count() or 1
    if args.vs_llama_bench:
        from specserve.tools.measure.llama_bench import compare_with_llama_bench, render_llama_peer

        data = compare_with_llama_bench(
            resolve_model(settings, settings.target),
            Path(args.vs_llama_bench),
            threads=threads,
            rounds=max(args.repeats, 1),
            progress=progress,
        )
        write_report(args.output_dir, data, render_llama_peer(data, command_line()), "llama_bench")
        return 0
    if args.grammar_cost:
        from specserve.tools.measure.grammar_cost import measure_grammar_cost, render_grammar_cost

        data = measure_grammar_cost(resolve_model(settings, settings.target), rounds=max(args.repeats, 3))
        write_report(args.output_dir, data, render_grammar_cost(data, command_line()), "grammar_cost")
        return 0
    if args.fresh_process:
        return _fresh_process(args, settings)
    if args.exact_cost:
        from specserve.tools.measure.exact_cost import measure_exact_cost

        cost = measure_exact_cost(
            resolve_model(settings, settings.target),
            threads,
            rounds=max(args.repeats, 3),
            stock_lib=args.stock_lib,
        )
        write_report(args.output_dir, cost, render_exact_cost(cost, command_line()), "exact_cost")
        return 0
    return _engine_bench(args, settings)


def _fresh_process(args: argparse.Namespace, settings: Settings) -> int:
    from specserve.tools.measure.fresh_generate import measure_fresh_generate, render_fresh_generate

    sampling(max_tokens=args.max_tokens)
    # Default prompts: first requests of kinds the engine workloads do not cover (tools/prompts/).
    prompts = _prompts(args) if args.prompts else builtin_rows("first-request")
    data = measure_fresh_generate(
        settings, prompts, args.max_tokens, rounds=max(args.repeats, 2), progress=progress, paired=args.paired
    )
    write_report(args.output_dir, data, render_fresh_generate(data, command_line()), "fresh_process")
    return 0


def _prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompts of --prompts (or the built-in ones), filtered by --kinds and --limit."""
    prompts = builtin_prompts(args.structured) if args.prompts is None else read_jsonl(Path(args.prompts))
    if args.kinds:
        kinds = set(args.kinds.split(","))
        prompts = [p for p in prompts if p["kind"] in kinds]
    if args.limit:
        per_kind: dict[str, int] = {}
        kept = []
        for p in prompts:
            per_kind[p["kind"]] = per_kind.get(p["kind"], 0) + 1
            if per_kind[p["kind"]] <= args.limit:
                kept.append(p)
        prompts = kept
    return prompts


def _engine_bench(args: argparse.Namespace, settings: Settings) -> int:
    sampling(max_tokens=args.max_tokens)  # checked before the models load
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if mode(m) is None]
    if unknown:
        raise ToolInputError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}, dflash2@B")
    if "plain" not in modes:
        modes.insert(0, "plain")
    prompts = _prompts(args)
    result = run_engine_bench(settings, prompts, modes, args.max_tokens, progress, args.repeats)
    data = result.as_dict()
    write_report(args.output_dir, data, render_markdown(data, command_line(), structured=args.structured))
    return 0
