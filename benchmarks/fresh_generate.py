"""``python -m benchmarks.fresh_generate``: plain vs the default policy, every run a new process.

A server's policy has a history (acceptance per drafter and bucket, a refined cost table); a user's
``specserve generate`` has none. This measures what that user sees: each (prompt, mode) is one fresh
``specserve generate --json --chat`` process, greedy, with the modes' order alternating round by round. Speed
is the decode phase's tokens/s as ``generate`` reports it; a prompt's ratio is the median over rounds of
auto / plain.

    python -m benchmarks.fresh_generate [--paired] [--repeats N] [--max-tokens N] [--prompts FILE]
        [--kinds K,…] [--limit N] [--output-dir DIR] [engine flags]

(formerly ``specserve bench --in-process --fresh-process [--paired]``) writes ``DIR/fresh_process.json`` and
``.md``: at least 2 rounds, the built-in first-request prompts unless ``--prompts`` (filtered by ``--kinds``
and ``--limit``); ``--paired``: both modes in one fresh process per round (fresh_pair.py).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.fresh_process import run_json_module
from benchmarks.harness import command_line, engine_flags, engine_parser, parse, run, settings_of
from specserve.config import Settings

MODULE = "benchmarks.fresh_generate"

MODE_ARGS = {"plain": ["--drafter", "none"], "auto": []}
"""Flags of each mode; auto is ``generate``'s defaults (cost policy over every loaded drafter)."""


def generate_args(settings: Settings) -> list[str]:
    """The engine flags a fresh process repeats from this run's settings (models, threads, mode, k)."""
    args = ["--target", settings.target, "--num-draft-tokens", str(settings.num_draft_tokens)]
    args += ["--draft", settings.draft] if settings.draft else []
    args += ["--threads", str(settings.threads)] if settings.threads else []
    args += ["--exact"] if settings.exact else ["--no-exact"]
    if settings.model_dir:
        args += ["--model-dir", str(settings.model_dir)]
    return args


def run_generate(prompt: str, max_tokens: int, args: list[str]) -> dict[str, Any]:
    """One fresh ``specserve generate`` process; its JSON result. Raises with its stderr on failure."""
    command = ["generate", "--json", "--chat", "--prompt", prompt, "--max-tokens", str(max_tokens), *args]
    return run_json_module("specserve.cli", command)


def run_pair(prompt: str, max_tokens: int, args: list[str], plain_first: bool) -> dict[str, Any]:
    """One fresh process decoding ``prompt`` under auto and plainly (fresh_pair.py); both results."""
    order = ["--plain-first"] if plain_first else []
    command = ["--prompt", prompt, "--max-tokens", str(max_tokens), *order, *args]
    return run_json_module("benchmarks.fresh_pair", command)


def measure_fresh_generate(
    settings: Settings,
    prompts: list[dict[str, Any]],
    max_tokens: int,
    rounds: int = 2,
    progress: Callable[[str], None] = lambda _m: None,
    paired: bool = False,
) -> dict[str, Any]:
    """Per prompt: tokens/s of each mode per round, the median auto / plain ratio, MAL and sameness.
    ``paired``: both modes in one fresh process per round (order alternating), not a process each."""
    base = generate_args(settings)
    rows: list[dict[str, Any]] = []
    for i, item in enumerate(prompts):
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODE_ARGS}
        for r in range(rounds):
            if paired:
                pair = run_pair(item["prompt"], max_tokens, base, plain_first=(r + i) % 2 == 1)
                for mode in MODE_ARGS:
                    runs[mode].append(pair[mode])
                progress(
                    f"[{i + 1}/{len(prompts)} round {r + 1}] {item['kind']:10} "
                    + " ".join(f"{m} {pair[m]['timings']['tokens_per_second']:6.2f}" for m in MODE_ARGS)
                    + " tok/s"
                )
                continue
            for mode in list(MODE_ARGS) if (r + i) % 2 == 0 else list(MODE_ARGS)[::-1]:
                out = run_generate(item["prompt"], max_tokens, [*base, *MODE_ARGS[mode]])
                runs[mode].append(out)
                progress(
                    f"[{i + 1}/{len(prompts)} round {r + 1}] {item['kind']:10} {mode:5} "
                    f"{out['timings']['tokens_per_second']:6.2f} tok/s"
                )
        ratios = [
            a["timings"]["tokens_per_second"] / p["timings"]["tokens_per_second"]
            for p, a in zip(runs["plain"], runs["auto"], strict=True)
            if p["timings"]["tokens_per_second"] > 0
        ]
        auto = runs["auto"]
        rows.append(
            {
                "kind": item["kind"],
                "tokens": len(auto[0]["token_ids"]),
                "plain_tok_s": [p["timings"]["tokens_per_second"] for p in runs["plain"]],
                "auto_tok_s": [a["timings"]["tokens_per_second"] for a in auto],
                "ratio": round(statistics.median(ratios), 3) if ratios else 0.0,
                "ratios": [round(x, 3) for x in ratios],
                "mean_acceptance_length": [a["speculative"]["mean_acceptance_length"] for a in auto],
                "drafts": [a["speculative"]["num_drafts"] for a in auto],
                "identical": all(
                    a["token_ids"] == p["token_ids"] for p, a in zip(runs["plain"], auto, strict=True)
                ),
                "drafters": auto[0]["engine"]["drafters"],
                "within_request": [a["within_request"]["ratio"] for a in auto if "within_request" in a],
            }
        )
    return {
        "max_tokens": max_tokens,
        "rounds": rounds,
        "paired": paired,
        "generate_args": base,
        "prompts": rows,
    }


def render_fresh_generate(data: dict[str, Any], command: str) -> str:
    how = (
        "every (prompt, round) a new process that decodes the prompt under auto (its first speculative "
        "request) and plainly, after an 8-token plain warm-up, order alternating"
        if data.get("paired")
        else "every (prompt, mode) a new `specserve generate --json --chat` process, mode order alternating"
    )
    within = all(row.get("within_request") for row in data["prompts"])
    lines = [
        "# Fresh processes: plain vs auto",
        "",
        f"`{command}` — {how}; greedy, {data['max_tokens']} tokens, {data['rounds']} rounds.",
        "",
        "| prompt | tokens | plain tok/s | auto tok/s | auto / plain (median; per round) | MAL | drafts "
        "| same |" + (" within request (min; per round) |" if within else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if within else ""),
    ]
    for row in data["prompts"]:
        lines.append(
            f"| {row['kind']} | {row['tokens']} | {' / '.join(f'{x:.2f}' for x in row['plain_tok_s'])} | "
            f"{' / '.join(f'{x:.2f}' for x in row['auto_tok_s'])} | **{row['ratio']:.3f}** "
            f"({' / '.join(f'{x:.3f}' for x in row['ratios'])}) | "
            f"{' / '.join(f'{x:.2f}' for x in row['mean_acceptance_length'])} | "
            f"{' / '.join(str(n) for n in row['drafts'])} | {'yes' if row['identical'] else 'NO'} |"
            + (
                f" **{min(row['within_request']):.3f}** "
                f"({' / '.join(f'{x:.3f}' for x in row['within_request'])}) |"
                if within
                else ""
            )
        )
    worst = min((row["ratio"] for row in data["prompts"]), default=0.0)
    lines += ["", f"Lowest ratio: **{worst:.3f}**."]
    if within:
        lowest = min(min(row["within_request"]) for row in data["prompts"])
        lines += [
            "",
            "Within request: auto's decode time without what its drafting steps cost beyond the plain steps "
            "their tokens replaced (each priced at the median plain step of the same request), over its "
            f"decode time — the policy's own gain or loss, without the drift between two decodes. Lowest "
            f"round: **{lowest:.3f}**.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from specserve.tools.flags import sampling
    from specserve.tools.measure.command import filter_prompts
    from specserve.tools.output import progress, write_report
    from specserve.tools.workloads import builtin_rows, read_jsonl

    parser = engine_parser(MODULE, __doc__)
    parser.add_argument(
        "--paired",
        action="store_true",
        help="Both modes in one fresh process per round, order alternating (the ratio then carries no "
        "drift between processes).",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompts", default=None, help="JSONL of {prompt, kind} (default: built-in).")
    parser.add_argument("--kinds", default=None, help="With --prompts: comma-separated prompt kinds.")
    parser.add_argument("--limit", type=int, default=None, help="With --prompts: prompts per kind.")
    engine_flags(parser)
    args = parse(parser, argv)
    settings = settings_of(args)
    sampling(max_tokens=args.max_tokens)  # checked before any process starts
    # Default prompts: first requests of kinds the engine workloads do not cover (tools/prompts/).
    if args.prompts:
        prompts = filter_prompts(read_jsonl(Path(args.prompts)), args.kinds, args.limit)
    else:
        prompts = builtin_rows("first-request")
    data = measure_fresh_generate(
        settings, prompts, args.max_tokens, rounds=max(args.repeats, 2), progress=progress, paired=args.paired
    )
    write_report(
        args.output_dir, data, render_fresh_generate(data, command_line(MODULE, argv)), "fresh_process"
    )
    return 0


if __name__ == "__main__":
    sys.exit(run(MODULE, main))
