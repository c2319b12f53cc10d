"""``specserve bench --in-process``: the parsed flags → the engine benchmark → a report on disk.

The engine benchmark: plain vs drafters vs the default policy, on the built-in prompts or ``--prompts``. The
project's own measurements that ran under further flags here (exact vs fast mode per call size, plain
decoding vs llama-bench, fresh processes, the grammar engine's cost) are ``python -m benchmarks.…`` in the
repository (benchmarks/), outside this package.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from specserve.config import Settings
from specserve.config_sources import load_settings
from specserve.tools.flags import sampling
from specserve.tools.measure.engine_bench import MODES, builtin_prompts, mode, run_engine_bench
from specserve.tools.measure.engine_report import render_markdown
from specserve.tools.output import command_line, progress, write_report
from specserve.tools.workloads import ToolInputError, read_jsonl


def measure_in_process(args: argparse.Namespace) -> int:
    settings = dataclasses.replace(load_settings(args, config_file=args.config), max_running=1)
    return _engine_bench(args, settings)


def _prompts(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prompts of --prompts (or the built-in ones), filtered by --kinds and --limit."""
    prompts = builtin_prompts(args.structured) if args.prompts is None else read_jsonl(Path(args.prompts))
    return filter_prompts(prompts, args.kinds, args.limit)


def filter_prompts(
    prompts: list[dict[str, Any]], kinds: str | None, limit: int | None
) -> list[dict[str, Any]]:
    """The prompts of the comma-separated ``kinds`` (all without), the first ``limit`` of each kind."""
    if kinds:
        wanted = set(kinds.split(","))
        prompts = [p for p in prompts if p["kind"] in wanted]
    if limit:
        per_kind: dict[str, int] = {}
        kept = []
        for p in prompts:
            per_kind[p["kind"]] = per_kind.get(p["kind"], 0) + 1
            if per_kind[p["kind"]] <= limit:
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
