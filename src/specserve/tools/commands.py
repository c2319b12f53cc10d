"""The ``bench``, ``verify``, ``evaluate`` and ``train-drafter`` subcommands (registered through
``cli.PLUGIN_COMMANDS``).

Parsing only: which tool runs is decided here, and each room's ``command`` module — imported when its command
runs — turns the parsed flags into that tool's typed options. So ``specserve --help`` imports none of the
tools' dependencies, and without them (the ``tools`` extra) a tool says so in one line.

User errors raise :class:`~specserve.tools.workloads.ToolInputError`: the CLI prints one line
``specserve: error: …`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from specserve.config import ENGINE_GROUPS
from specserve.config_sources import add_arguments
from specserve.tools.workloads import ToolInputError

TOOL_DEPENDENCIES = ("httpx", "scipy", "matplotlib")
"""What the ``tools`` extra installs (pyproject.toml)."""

MOVED_BENCH_FLAGS: dict[str, tuple[str, str]] = {
    "--exact-cost": ("benchmarks.exact_cost", ""),
    "--stock-lib": ("benchmarks.exact_cost --stock-lib DIR", "DIR"),
    "--vs-llama-bench": ("benchmarks.llama_bench --vs-llama-bench PATH", "PATH"),
    "--fresh-process": ("benchmarks.fresh_generate", ""),
    "--paired": ("benchmarks.fresh_generate --paired", ""),
    "--grammar-cost": ("benchmarks.grammar_cost", ""),
}
"""``specserve bench`` flags of measurements that moved to the repository's benchmarks/ (outside the
wheel): flag → (its command now, after ``python -m``; the flag's value, if it takes one). Each is still
parsed, so that giving it fails with a line naming the command instead of doing something else."""


def add_subcommands(sub: Any) -> None:
    """``bench``, ``verify`` and ``evaluate`` under the ``specserve`` parser's subcommands."""
    _add_bench(sub)
    _add_verify(sub)
    _add_evaluate(sub)
    _add_train_drafter(sub)


def _add_bench(sub: Any) -> None:
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
    http.add_argument(
        "--agent-modes",
        action="append",
        default=[],
        help="With --workload agent: specserve modes (plain, ngram, suffix, auto; default all).",
    )
    http.add_argument("--temperature", type=float, default=0.0)
    http.add_argument("--seed", type=int, default=None)
    http.add_argument("--ignore-eos", action="store_true", help="Generate max tokens (ignore_eos extension).")
    engine = bench.add_argument_group("engine benchmark (--in-process)")
    engine.add_argument("--modes", default="plain,ngram,draft-model,auto", help="Comma-separated modes.")
    engine.add_argument("--kinds", default=None, help="Comma-separated prompt kinds (default: all).")
    engine.add_argument(
        "--structured",
        action="store_true",
        help="The schema-constrained workloads (JSON Schema per prompt): grammar-forced share, grammar cost.",
    )
    engine.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="Rounds over the prompts (mode order reversed every other round).",
    )
    for flag, (_, takes) in MOVED_BENCH_FLAGS.items():  # not features: a one-line error, absent from --help
        if takes:
            engine.add_argument(flag, default=None, metavar=takes, help=argparse.SUPPRESS)
        else:
            engine.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    engine.add_argument("--config", default=None)
    add_arguments(bench, ENGINE_GROUPS)
    bench.set_defaults(handler=_bench)


def _add_verify(sub: Any) -> None:
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
    add_arguments(verify, ENGINE_GROUPS, exclude=("draft_policy", "load_draft"))
    verify.set_defaults(handler=_verify)


def _add_evaluate(sub: Any) -> None:
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
    # evaluate tries every drafter and draft length itself (--drafters, --draft-lengths)
    add_arguments(
        evaluate, ENGINE_GROUPS, exclude=("drafter", "num_draft_tokens", "draft_policy", "load_draft")
    )
    evaluate.set_defaults(handler=_evaluate)


def _add_train_drafter(sub: Any) -> None:
    train = sub.add_parser(
        "train-drafter", help="Train a DFlash2 block drafter for the target on its own responses (torch)."
    )
    train.add_argument("--prompts", required=True, help="JSONL of {prompt} (or one prompt per line).")
    train.add_argument("--output-dir", required=True, help="Checkpoint directory (resumed when it has one).")
    train.add_argument("--steps", type=int, default=1000, help="Optimizer steps (one example each).")
    train.add_argument("--time-limit", type=float, default=0.0, help="Seconds of training (0: no limit).")
    train.add_argument("--block-size", type=int, default=16, help="Block of the new drafter.")
    train.add_argument("--layers", type=int, default=1, help="Drafter layers.")
    train.add_argument("--target-layers", type=int, default=3, help="Target layers read (spread).")
    train.add_argument("--target-layer-ids", default=None, help="Or exactly these (comma-separated).")
    train.add_argument("--top-k", type=int, default=16, help="Selector candidates per position.")
    train.add_argument("--selector-rank", type=int, default=64)
    train.add_argument("--anchors", type=int, default=8, help="Blocks per example and step.")
    train.add_argument("--gamma", type=float, default=7.0, help="Position weight decay exp(-(k-1)/gamma).")
    train.add_argument("--lr", type=float, default=6e-4)
    train.add_argument("--max-new-tokens", type=int, default=128, help="Response length generated.")
    train.add_argument("--temperature", type=float, default=0.0, help="Of the generated responses.")
    train.add_argument("--context", type=int, default=1024, help="Context of a training sequence.")
    train.add_argument("--checkpoint-every", type=int, default=100)
    train.add_argument(
        "--no-resume",
        action="store_true",
        help="Start over even if a checkpoint exists (its data.pt is reused).",
    )
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--config", default=None)
    add_arguments(train, ("models",), exclude=("draft", "backend", "exact", "context_size"))
    train.set_defaults(handler=_train_drafter)


def _train_drafter(args: argparse.Namespace) -> int:
    from specserve.tools.train_drafter.command import train_drafter_command

    return train_drafter_command(args)


def _add_workload_args(parser: Any) -> None:
    parser.add_argument("--workload", nargs="+", action="extend", default=[], help="Workload names.")
    parser.add_argument(
        "--api-key", default=None, help="Bearer token for the server(s) (default: $OPENAI_API_KEY)."
    )
    parser.add_argument("--model", default=None, help="Model name to request (default: /v1/models' first).")
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds per request.")


def require_tools(command: str) -> None:
    """A one-line error naming the extra when the tools' dependencies are not installed."""
    missing = [name for name in TOOL_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        raise ToolInputError(
            f"specserve {command} needs the tools extra (missing: {', '.join(missing)}): "
            "pip install 'specserve[tools]'"
        )


def _bench(args: argparse.Namespace) -> int:
    for flag, (command, _) in MOVED_BENCH_FLAGS.items():
        if getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            raise ToolInputError(
                f"{flag} moved out of specserve bench: run `python -m {command}` from the repository root "
                "of a specserve checkout (benchmarks/)"
            )
    require_tools("bench")
    if args.in_process == bool(args.url):
        raise ToolInputError("give either --url BASE_URL or --in-process")
    if args.in_process:
        from specserve.tools.measure.command import measure_in_process

        return measure_in_process(args)
    from specserve.tools.loadgen.command import bench_over_http

    return bench_over_http(args)


def _verify(args: argparse.Namespace) -> int:
    require_tools("verify")
    from specserve.tools.rollout.command import verify

    return verify(args)


def _evaluate(args: argparse.Namespace) -> int:
    require_tools("evaluate")
    from specserve.tools.rollout.command import evaluate

    return evaluate(args)
