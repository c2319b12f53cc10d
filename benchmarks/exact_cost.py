"""What exact mode costs: target decode time per call size, exact vs fast mode (``--no-exact``), and, given a
stock llama.cpp build (``--stock-lib DIR``: its shared libraries, e.g. scripts/build-stock-llama.sh's), exact
mode against the unpatched kernels a user's own llama.cpp would run.

Exact and fast mode are the same patched build (fast mode only skips the load-time self-check and its
fallback), so exact / fast shows what the self-check and its fallback cost; exact / stock shows what the
patched kernels cost. Each arm runs in a fresh process per round
(:mod:`benchmarks.fresh_process` says why not all in one), the order rotating round by round,
and the report gives the median over rounds of each process's median.

    python -m benchmarks.exact_cost [--stock-lib DIR] [--repeats N] [--output-dir DIR] [engine flags]

(formerly ``specserve bench --in-process --exact-cost``) writes ``DIR/exact_cost.json`` and ``.md``: at least
3 rounds, the target of the engine flags (``--target``, ``--threads``, ``--model-dir`` …). One arm of one
round, in the fresh process this starts, is ``python -m benchmarks.exact_cost --arm MODEL EXACT THREADS SIZES
REPEATS``: it prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from benchmarks.fresh_process import run_json_module
from benchmarks.harness import command_line, engine_flags, engine_parser, parse, run, settings_of, threads_of

MODULE = "benchmarks.exact_cost"
ARM = "--arm"
"""The first argument of one arm's process (see ``measure_exact_cost``)."""
SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32)


def time_calls(
    model_path: str, exact: bool, threads: int, sizes: tuple[int, ...], repeats: int
) -> dict[str, Any]:
    """In this process: median seconds per decode call of each size after a 70-token context, with the
    tiled kernel's start an engine would use (measured, unless the environment sets it or a stock build
    cannot move it)."""
    from specserve.backends.base import DecodeChunk
    from specserve.backends.llama_cpp import LlamaCppRuntime
    from specserve.backends.llama_cpp_tiled import tiled_min_batch

    runtime = LlamaCppRuntime(model_path, context_per_sequence=1024, n_threads=threads, exact=exact)
    try:
        runtime.tune_kernels(0)
        context = runtime.tokenize("def example(values):\n    return [v * 2 for v in values]\n" * 4)
        runtime.decode([DecodeChunk(0, context, 0, 1)])
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(repeats + 1):  # the first pass warms every shape up and is dropped
            for n in sizes:
                start = time.perf_counter()
                runtime.decode([DecodeChunk(0, context[:n], len(context), n)])
                times[n].append(time.perf_counter() - start)
                runtime.truncate(0, len(context))
        return {
            "exactness": runtime.info.exactness,
            "tiled_min_batch": tiled_min_batch(),
            "ms": {n: statistics.median(t[1:]) * 1000 for n, t in times.items()},
        }
    finally:
        runtime.close()


def measure_exact_cost(
    model_path: str,
    threads: int,
    rounds: int = 3,
    sizes: tuple[int, ...] = SIZES,
    repeats: int = 5,
    stock_lib: str | None = None,
) -> dict[str, Any]:
    """Median ms per call size of each arm (exact, fast, and stock where ``stock_lib`` is given), each arm a
    fresh process per round, the order rotating."""
    modes = ["exact", "fast", *(["stock"] if stock_lib else [])]
    per_mode: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    exactness = ""
    tiled: dict[str, list[int | None]] = {mode: [] for mode in modes}
    for r in range(rounds):
        for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
            args = [
                model_path,
                str(int(mode == "exact")),
                str(threads),
                ",".join(map(str, sizes)),
                str(repeats),
            ]
            env = {"LLAMA_CPP_LIB_PATH": stock_lib} if mode == "stock" and stock_lib else None
            result = run_json_module(MODULE, [ARM, *args], env)
            per_mode[mode].append(result["ms"])
            tiled[mode].append(result.get("tiled_min_batch"))
            if mode == "exact":
                exactness = result["exactness"]
    calls = {
        str(n): {
            f"{mode}_ms": round(statistics.median(run[str(n)] for run in runs), 2)
            for mode, runs in per_mode.items()
        }
        for n in sizes
    }
    return {
        "exactness": exactness,
        "rounds": rounds,
        "stock_lib": stock_lib,
        "tiled_min_batch": tiled,
        "calls": calls,
    }


def render_exact_cost(data: dict[str, Any], command: str) -> str:
    stock = data.get("stock_lib")
    out = [
        "## Exact mode cost",
        "",
        f"Command: `{command}`",
        "",
        f"Median ms per target decode call, exact mode (`{data['exactness']}`) vs fast mode (`--no-exact`, "
        "the same build)"
        + (f" and vs a stock llama.cpp build (`{stock}`, fast mode)" if stock else "")
        + f"; each arm a fresh process per round, {data['rounds']} rounds, order rotating (median over "
        "rounds of each round's median):",
        "",
        "| tokens in the call | exact ms | fast ms | exact / fast |"
        + (" stock ms | exact / stock |" if stock else ""),
        "|---|---|---|---|" + ("---|---|" if stock else ""),
    ]
    for n, row in data["calls"].items():
        exact = row["exact_ms"]
        line = f"| {n} | {exact:.1f} | {row['fast_ms']:.1f} | {exact / row['fast_ms']:.2f} |"
        if stock:
            line += f" {row['stock_ms']:.1f} | {exact / row['stock_ms']:.2f} |"
        out.append(line)
    starts = {mode: sorted({str(t) for t in runs}) for mode, runs in data.get("tiled_min_batch", {}).items()}
    if starts:
        listed = "; ".join(f"{mode}: {', '.join(values)}" for mode, values in starts.items())
        out += ["", f"Tiled K-quant kernel from (rows, per process; None: the build cannot say): {listed}."]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == [ARM]:  # one arm of one round (see measure_exact_cost)
        model, exact, threads, sizes, repeats = argv[1:6]
        sizes_of = tuple(int(s) for s in sizes.split(","))
        print(json.dumps(time_calls(model, exact == "1", int(threads), sizes_of, int(repeats))))
        return 0
    parser = engine_parser(MODULE, __doc__)
    parser.add_argument(
        "--stock-lib",
        default=None,
        metavar="DIR",
        help="Also time a stock llama.cpp build's shared libraries in DIR (e.g. the bin/ of "
        "scripts/build-stock-llama.sh), so exact mode is priced against unpatched kernels.",
    )
    engine_flags(parser)
    args = parse(parser, argv)
    from specserve.tools.measure.engine_bench import resolve_model
    from specserve.tools.output import write_report

    settings = settings_of(args)
    cost = measure_exact_cost(
        resolve_model(settings, settings.target),
        threads_of(settings),
        rounds=max(args.repeats, 3),
        stock_lib=args.stock_lib,
    )
    write_report(args.output_dir, cost, render_exact_cost(cost, command_line(MODULE, argv)), "exact_cost")
    return 0


if __name__ == "__main__":
    sys.exit(run(MODULE, main))
