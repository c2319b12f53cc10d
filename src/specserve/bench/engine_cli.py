"""``specserve bench --in-process``: the engine benchmark (plain vs drafters vs the default policy)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specserve.bench.engine_bench import (
    MODES,
    builtin_prompts,
    resolve_model,
    run_engine_bench,
)
from specserve.bench.engine_report import render_exact_cost, render_markdown
from specserve.bench.workloads import BenchInputError, read_jsonl
from specserve.config import Settings


def bench_in_process(args: argparse.Namespace, settings: Settings, command: str) -> int:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    threads = settings.threads or os.cpu_count() or 1
    if args.vs_llama_bench:
        from specserve.bench.llama_peer import compare_with_llama_bench, render_llama_peer

        data = compare_with_llama_bench(
            resolve_model(settings, settings.target),
            Path(args.vs_llama_bench),
            threads=threads,
            rounds=max(args.repeats, 1),
            progress=lambda m: print(m, file=sys.stderr),
        )
        _write(out, "llama_bench", data, render_llama_peer(data, command))
        return 0
    if args.exact_cost:
        from specserve.bench.call_cost import measure_exact_cost

        cost = measure_exact_cost(
            resolve_model(settings, settings.target), threads, rounds=max(args.repeats, 3)
        )
        _write(out, "exact_cost", cost, render_exact_cost(cost, command))
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise BenchInputError(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    if "plain" not in modes:
        modes.insert(0, "plain")
    prompts = builtin_prompts() if args.prompts is None else read_jsonl(Path(args.prompts))
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
    result = run_engine_bench(
        settings,
        prompts,
        modes,
        args.max_tokens,
        progress=lambda m: print(m, file=sys.stderr),
        repeats=args.repeats,
    )
    data = result.as_dict()
    _write(out, "report", data, render_markdown(data, command))
    return 0


def _write(out: Path, stem: str, data: dict[str, object], markdown: str) -> None:
    """``<stem>.json`` and ``<stem>.md`` in ``out``, and the Markdown on stdout."""
    (out / f"{stem}.json").write_text(json.dumps(data, indent=2))
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)
