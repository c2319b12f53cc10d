"""The ``bench``, ``verify`` and ``evaluate`` subcommands (registered through ``cli.PLUGIN_COMMANDS``).

User errors raise :class:`BenchInputError` (a ValueError): the CLI prints one line ``specserve: error: …``
and exits with status 2. ``verify`` exits 0 when the check passes and 1 when it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from specserve.bench.workloads import BenchInputError, parse_float_list, parse_int_list, select_workloads
from specserve.config import Settings, add_arguments, load_settings

BENCH_SETTINGS = (
    "target", "draft", "model_dir", "context_size", "threads", "exact", "drafter", "num_draft_tokens",
    "draft_policy", "ngram_min_n", "draft_p_min", "load_draft", "gpu_layers",
)  # fmt: skip
MODEL_SETTINGS = (
    "target", "draft", "model_dir", "context_size", "threads", "exact", "ngram_min_n", "draft_p_min",
    "gpu_layers", "calibration_cache",
)  # fmt: skip


def add_subcommands(sub: Any) -> None:
    bench = sub.add_parser("bench", help="Benchmark a server over HTTP (--url) or the engine (--in-process).")
    bench.add_argument("--url", default=None, help="Base URL of an OpenAI-compatible server.")
    bench.add_argument("--in-process", action="store_true", help="Benchmark the engine without a server.")
    bench.add_argument("--output-dir", default="bench-out", help="Where report.json, report.md, *.png go.")
    bench.add_argument(
        "--prompts", default=None, help="JSONL of {prompt, workload|kind} (default: built-in)."
    )
    bench.add_argument("--max-tokens", type=int, default=128)
    bench.add_argument("--limit", type=int, default=None, help="Prompts per workload.")
    http = bench.add_argument_group(
        "HTTP load generator (--url)",
        "With --compare-spec, --drafter and --num-draft-tokens (below) go into mode on's request extension.",
    )
    _add_workload_args(http)
    http.add_argument("--concurrency", default="1", help="Comma-separated concurrent clients (e.g. 1,2,4).")
    http.add_argument("--rate", default=None, help="Comma-separated request rates per mode (open loop).")
    http.add_argument("--requests", type=int, default=8, help="Requests per workload × mode × level.")
    http.add_argument("--compare-spec", action="store_true", help="Speculation on vs off, interleaved.")
    http.add_argument("--peer", action="store_true", help="--url is not specserve: send plain requests only.")
    http.add_argument(
        "--peer-url", action="append", default=[], metavar="NAME=URL", help="Another server, as mode NAME."
    )
    http.add_argument("--temperature", type=float, default=0.0)
    http.add_argument("--seed", type=int, default=None)
    http.add_argument("--ignore-eos", action="store_true", help="Generate max tokens (ignore_eos extension).")
    engine = bench.add_argument_group("engine benchmark (--in-process)")
    engine.add_argument("--modes", default="plain,ngram,draft-model,auto", help="Comma-separated modes.")
    engine.add_argument("--kinds", default=None, help="Comma-separated prompt kinds (default: all).")
    engine.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Rounds over the prompts (mode order reversed every other round).",
    )
    engine.add_argument(
        "--exact-cost",
        action="store_true",
        help="Only measure exact vs fast mode decode cost per call size (each mode a fresh process per "
        "round; --repeats rounds, at least 3).",
    )
    engine.add_argument(
        "--vs-llama-bench",
        default=None,
        metavar="PATH",
        help="Only compare plain decoding (pp, tg) with this llama-bench binary, rounds interleaved "
        "(--repeats rounds).",
    )
    engine.add_argument("--config", default=None)
    add_arguments(bench, BENCH_SETTINGS)
    bench.set_defaults(handler=_bench)

    verify = sub.add_parser("verify", help="Check that speculation leaves the output unchanged (exit 0/1).")
    verify.add_argument("--url", default=None, help="A specserve server to check over HTTP.")
    verify.add_argument("--in-process", action="store_true", help="Load the models and check the engine.")
    verify.add_argument("--output-dir", default="verify-out")
    verify.add_argument("--prompts", default=None)
    verify.add_argument("--limit", type=int, default=2, help="Prompts per workload (default 2).")
    verify.add_argument("--max-tokens", type=int, default=64, help="Greedy output length.")
    verify.add_argument("--seeds", type=int, default=40, help="Samples per arm and prompt (0: greedy only).")
    verify.add_argument("--temperature", type=float, default=1.0, help="Of the sampled check.")
    verify.add_argument("--top-k", type=int, default=0, help="Of the sampled check (0 disables).")
    verify.add_argument("--sample-tokens", type=int, default=4, help="Tokens per sample compared.")
    verify.add_argument("--alpha", type=float, default=0.01, help="Significance level of the sampled check.")
    verify.add_argument("--seed", type=int, default=0, help="First seed.")
    verify.add_argument("--reference-target", default=None, help="In-process: plain arm on this model.")
    verify.add_argument("--reference-url", default=None, help="HTTP: plain arm from this server.")
    _add_workload_args(verify)
    verify.add_argument("--config", default=None)
    add_arguments(verify, (*MODEL_SETTINGS, "drafter", "num_draft_tokens"))
    verify.set_defaults(handler=_verify)

    evaluate = sub.add_parser("evaluate", help="Measure acceptance per drafter and draft length; recommend.")
    evaluate.add_argument("--prompts", default=None)
    evaluate.add_argument("--workload", nargs="+", action="extend", default=[], help="Workload names.")
    evaluate.add_argument("--limit", type=int, default=3, help="Prompts per workload (default 3).")
    evaluate.add_argument("--max-tokens", type=int, default=128)
    evaluate.add_argument("--drafters", default=None, help="Comma-separated (default: every loaded one).")
    evaluate.add_argument("--draft-lengths", default="1,2,4,6,8,16")
    evaluate.add_argument("--temperature", type=float, default=0.0)
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--output-dir", default="evaluate-out")
    evaluate.add_argument("--config", default=None)
    add_arguments(evaluate, MODEL_SETTINGS)
    evaluate.set_defaults(handler=_evaluate)


def _add_workload_args(parser: Any) -> None:
    parser.add_argument("--workload", nargs="+", action="extend", default=[], help="Workload names.")
    parser.add_argument(
        "--api-key", default=None, help="Bearer token for the server(s) (default: $OPENAI_API_KEY)."
    )
    parser.add_argument("--model", default=None, help="Model name to request (default: /v1/models' first).")
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds per request.")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _command() -> str:
    return "specserve " + shlex.join(sys.argv[1:])


def _names(values: list[str]) -> list[str]:
    return [n for v in values for n in v.split(",") if n]


def _settings(args: argparse.Namespace) -> Settings:
    return dataclasses.replace(load_settings(args, config_file=args.config), max_running=1)


def _write(out_dir: str, report: dict[str, Any], markdown: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    (out / "report.md").write_text(markdown)
    print(markdown, end="")
    return out


def _one_source(args: argparse.Namespace) -> None:
    if args.in_process == bool(args.url):
        raise BenchInputError("give either --url BASE_URL or --in-process")


# -- bench ----------------------------------------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    _one_source(args)
    if args.in_process:
        from specserve.bench.engine_cli import bench_in_process

        return bench_in_process(args, _settings(args), _command())
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    from specserve.bench.prefix_bench import PREFIX_WORKLOADS

    names = _names(args.workload)
    if names and any(n in PREFIX_WORKLOADS for n in names):
        return _prefix_bench(args, names)
    from specserve.bench.bench_report import render_markdown
    from specserve.bench.http_bench import run_http_bench
    from specserve.bench.plots import write_plots

    workloads = select_workloads(_names(args.workload), args.prompts, args.limit)
    concurrency = parse_int_list(args.concurrency, "--concurrency")
    rates = parse_float_list(args.rate, "--rate") if args.rate else None
    if args.requests < 1 or args.max_tokens < 1:
        raise BenchInputError("--requests and --max-tokens must be >= 1")
    report = asyncio.run(run_http_bench(args, workloads, concurrency, rates, _progress))
    report = {"command": _command(), "date": time.strftime("%Y-%m-%d %H:%M"), **report}
    out = _write(args.output_dir, report, render_markdown(report))
    write_plots(report, out)
    return 0


def _prefix_bench(args: argparse.Namespace, names: list[str]) -> int:
    from specserve.bench.prefix_bench import PREFIX_WORKLOADS, render_prefix, run_prefix_bench

    if not all(n in PREFIX_WORKLOADS for n in names):
        raise BenchInputError(f"run {', '.join(PREFIX_WORKLOADS)} apart from other workloads")
    if args.max_tokens < 1 or args.requests < 1:
        raise BenchInputError("--requests and --max-tokens must be >= 1")
    report = asyncio.run(run_prefix_bench(args, names, args.requests, _progress))
    report = {"command": _command(), "date": time.strftime("%Y-%m-%d %H:%M"), **report}
    _write(args.output_dir, report, render_prefix(report))
    return 0


# -- verify ---------------------------------------------------------------------------------------


def _verify(args: argparse.Namespace) -> int:
    from specserve.bench.tool_reports import render_verify
    from specserve.bench.verify_tool import VerifyOptions

    _one_source(args)
    if args.seeds < 0 or args.sample_tokens < 1 or args.max_tokens < 1 or not 0 < args.alpha < 1:
        raise BenchInputError("need --seeds >= 0, --sample-tokens >= 1, --max-tokens >= 1, 0 < --alpha < 1")
    if args.seeds and args.temperature <= 0:
        raise BenchInputError("the sampled check needs --temperature > 0 (or --seeds 0)")
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    workloads = select_workloads(_names(args.workload), args.prompts, args.limit)
    options = VerifyOptions(
        args.max_tokens, args.seeds, args.temperature, args.top_k, args.sample_tokens, args.alpha, args.seed
    )
    if args.in_process:
        result, meta = _verify_in_process(args, workloads, options)
    else:
        from specserve.bench.http_bench import run_http_verify

        result, meta = asyncio.run(run_http_verify(args, workloads, options, _progress))
    report = {"command": _command(), "date": time.strftime("%Y-%m-%d %H:%M"), **meta, **result.as_dict()}
    _write(args.output_dir, report, render_verify(report))
    _progress(f"verify: {'PASS' if result.passed else 'FAIL'}")
    return 0 if result.passed else 1


def _verify_in_process(args: argparse.Namespace, workloads: Any, options: Any) -> tuple[Any, dict[str, Any]]:
    from specserve.bench.inprocess import load_models, open_reference
    from specserve.bench.verify_tool import verify_in_process

    settings = _settings(args)
    with load_models(settings, with_draft=settings.drafter in ("auto", "draft-model")) as models:
        arms: list[str] = list(models.drafters)
        if settings.drafter in ("ngram", "draft-model"):
            if settings.drafter not in models.drafters:
                raise BenchInputError(f"drafter {settings.drafter} is not loaded (give --draft PATH)")
            arms = [settings.drafter]
        k = max(1, min(settings.num_draft_tokens, models.max_draft_tokens))
        reference = open_reference(settings, args.reference_target) if args.reference_target else None
        try:
            if reference is not None and reference.info.vocab_size != models.target.info.vocab_size:
                raise BenchInputError("--reference-target has a different vocabulary size than the target")
            result = verify_in_process(models, arms, k, workloads, options, _progress, reference)
        finally:
            if reference is not None:
                reference.close()
    meta: dict[str, Any] = {
        "mode": "in-process",
        "target": settings.target,
        "draft": settings.draft,
        "arms": arms,
    }
    meta |= {"num_draft_tokens": k, "exact": settings.exact, "reference_target": args.reference_target}
    return result, meta


# -- evaluate -------------------------------------------------------------------------------------


def _evaluate(args: argparse.Namespace) -> int:
    from specserve.bench.evaluate_tool import build_report, configurations, evaluate
    from specserve.bench.inprocess import load_models
    from specserve.bench.tool_reports import render_evaluate
    from specserve.request import SamplingParams

    workloads = select_workloads(_names(args.workload), args.prompts, args.limit)
    lengths = parse_int_list(args.draft_lengths, "--draft-lengths")
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    settings = _settings(args)
    with load_models(settings) as models:
        drafters = _names([args.drafters]) if args.drafters else list(models.drafters)
        missing = [d for d in drafters if d not in models.drafters]
        if missing:
            raise BenchInputError(
                f"drafter(s) {', '.join(missing)} not loaded; loaded: {', '.join(models.drafters)}"
            )
        configs, notes = configurations(models, drafters, lengths)
        tallies = evaluate(models, workloads, configs, params, _progress)
        meta = {
            "command": _command(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "target": settings.target,
            "draft": settings.draft,
            "exact": settings.exact,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "notes": notes,
        }
        report = build_report(tallies, configs, models.calibrated, meta)
    _write(args.output_dir, report, render_evaluate(report))
    return 0
