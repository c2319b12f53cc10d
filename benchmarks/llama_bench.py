"""Plain decoding against llama.cpp's own ``llama-bench``, rounds interleaved in one run.

What a user compares before trusting a wrapper: is specserve's plain path (exact mode, the default) as fast
as llama.cpp itself on the same model and threads? Each round runs ``llama-bench`` once (pp = prompt
processing of ``n_prompt`` tokens in one batch, tg = ``n_gen`` one-token steps from an empty context, as
llama-bench defines them) and then the same two tests on specserve's runtimes:

* ``runtime exact`` / ``runtime fast``: the llama.cpp runtime in exact mode and in ``--no-exact`` mode, the
  same decode calls as llama-bench makes (what the kernels and the binding cost);
* ``engine plain``: tg through the whole engine (scheduling, greedy choice, stop checks, detokenizing) with
  speculation off, ``n_gen`` tokens after a one-token prompt (what a request costs without the server).

Every side runs in a fresh process, as llama-bench does, in an order rotated every round. Ratios are per
round (specserve / llama-bench) and the report gives their median, so a slow moment of the machine hits
both sides of a ratio.

    python -m benchmarks.llama_bench --vs-llama-bench PATH [--repeats N] [--output-dir DIR] [engine flags]

(formerly ``specserve bench --in-process --vs-llama-bench PATH``) writes ``DIR/llama_bench.json`` and
``.md``: ``--repeats`` rounds, the target and threads of the engine flags. One specserve side of a round, in
the fresh process this starts, is ``python -m benchmarks.llama_bench --side MODEL EXACT THREADS N_PROMPT
N_GEN SEED``: it prints one JSON line.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.fresh_process import run_json_module
from benchmarks.harness import command_line, engine_flags, engine_parser, parse, run, settings_of, threads_of
from specserve.backends.base import DecodeChunk, HostRuntime
from specserve.engine.builder import flat_costs
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.request import SamplingParams

SIDES = ("llama-bench", "runtime exact", "runtime fast", "engine plain")
MODULE = "benchmarks.llama_bench"
SIDE = "--side"
"""The first argument of one side's process (see ``_side_in_subprocess``)."""


def run_llama_bench(binary: Path, model: str, threads: int, n_prompt: int, n_gen: int) -> dict[str, float]:
    """One llama-bench repetition of pp and tg; tokens/s per test."""
    cmd = [str(binary), "-m", model, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen)]
    done = subprocess.run([*cmd, "-r", "1", "-o", "json"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
    tests = json.loads(done.stdout)
    out = {}
    for test in tests:
        key = "pp" if test["n_prompt"] > 0 else "tg"
        out[key] = float(test["avg_ts"])
    return out


def runtime_tests(runtime: HostRuntime, n_prompt: int, n_gen: int, seed: int) -> dict[str, float]:
    """llama-bench's pp and tg on a runtime: random tokens, sequence 0 emptied before each test."""
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, min(runtime.info.vocab_size, 50_000), n_prompt + n_gen)]
    runtime.free(0)
    start = time.perf_counter()
    runtime.decode([DecodeChunk(0, tokens[:n_prompt], 0, 1)])
    pp = n_prompt / (time.perf_counter() - start)
    runtime.free(0)
    start = time.perf_counter()
    for i in range(n_gen):
        runtime.decode([DecodeChunk(0, [tokens[n_prompt + i]], i, 1)])
    tg = n_gen / (time.perf_counter() - start)
    runtime.free(0)
    return {"pp": pp, "tg": tg}


def engine_tg(runtime: HostRuntime, n_gen: int) -> float:
    """Tokens/s of plain greedy generation through the engine, after the first token (one-token prompt)."""
    costs = CostModel(flat_costs())  # plain decoding consults no costs
    options = EngineOptions((), 0, speculation_enabled=False)
    engine = SpeculativeEngine(runtime, {}, FixedLengthPolicy(), costs, options)
    seq = engine.add_request("peer-0", runtime.tokenize("def", add_special=False)[:1], _greedy(n_gen))
    while engine.has_work():
        engine.step()
    assert seq.first_token_time is not None and seq.finish_time is not None
    return (len(seq.output_ids) - 1) / (seq.finish_time - seq.first_token_time)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def measure_side(
    model_path: str, exact: bool, threads: int, n_prompt: int, n_gen: int, seed: int
) -> dict[str, Any]:
    """One specserve side of a round in this process: load the target, run pp/tg (and, exact, the engine)."""
    from specserve.backends.llama_cpp import LlamaCppRuntime

    runtime = LlamaCppRuntime(model_path, context_per_sequence=4096, n_threads=threads, exact=exact)
    try:
        # The first calls of a shape pay one-off allocations; llama-bench warms up too.
        runtime_tests(runtime, 16, 4, seed)
        out: dict[str, Any] = {"runtime": runtime_tests(runtime, n_prompt, n_gen, seed)}
        if exact:
            out["engine"] = {"tg": engine_tg(runtime, n_gen)}
        out["exactness"] = runtime.info.exactness
        return out
    finally:
        runtime.close()


def _side_in_subprocess(
    model_path: str, exact: bool, threads: int, n_prompt: int, n_gen: int, seed: int
) -> dict[str, Any]:
    """``measure_side`` in a fresh process, as llama-bench runs in one (see ``fresh_process``)."""
    args = [model_path, str(int(exact)), str(threads), str(n_prompt), str(n_gen), str(seed)]
    return run_json_module(MODULE, [SIDE, *args])


def compare_with_llama_bench(
    model_path: str,
    llama_bench: Path,
    threads: int,
    rounds: int = 3,
    n_prompt: int = 256,
    n_gen: int = 128,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """``rounds`` rounds of every side, each side a fresh process, the order rotated every round; tokens/s
    per round and median ratios to llama-bench."""
    per_round: list[dict[str, dict[str, float]]] = []
    exactness = ""
    for r in range(rounds):
        row: dict[str, dict[str, float]] = {}
        jobs = ["llama-bench", "exact", "fast"]
        for job in jobs[r % 3 :] + jobs[: r % 3]:
            if job == "llama-bench":
                row["llama-bench"] = run_llama_bench(llama_bench, model_path, threads, n_prompt, n_gen)
            elif job == "exact":
                measured = _side_in_subprocess(model_path, True, threads, n_prompt, n_gen, r)
                row["runtime exact"], row["engine plain"] = measured["runtime"], measured["engine"]
                exactness = measured["exactness"]
            else:
                row["runtime fast"] = _side_in_subprocess(model_path, False, threads, n_prompt, n_gen, r)[
                    "runtime"
                ]
        per_round.append({side: row[side] for side in SIDES})
        progress(f"round {r + 1}/{rounds}: " + json.dumps(per_round[-1]))
    ratios: dict[str, dict[str, float]] = {}
    for side in SIDES[1:]:
        for test in ("pp", "tg"):
            values = [row[side][test] / row["llama-bench"][test] for row in per_round if test in row[side]]
            if values:
                ratios.setdefault(side, {})[test] = round(statistics.median(values), 3)
    return {
        "settings": {"model": model_path, "threads": threads, "n_prompt": n_prompt, "n_gen": n_gen},
        "exactness": exactness,
        "rounds": per_round,
        "median_ratio_to_llama_bench": ratios,
    }


def render_llama_peer(data: dict[str, Any], command: str) -> str:
    s = data["settings"]
    lines = [
        f"Plain decoding vs llama.cpp's `llama-bench` ({s['threads']} threads, pp{s['n_prompt']}, "
        f"tg{s['n_gen']}), {len(data['rounds'])} interleaved rounds; "
        f"exact mode ran as `{data['exactness']}`.",
        "",
        "| side | pp tok/s (per round) | tg tok/s (per round) | pp / llama-bench | tg / llama-bench |",
        "|---|---|---|---|---|",
    ]
    for side in SIDES:
        pp = " / ".join(f"{row[side]['pp']:.1f}" for row in data["rounds"] if "pp" in row[side]) or "–"
        tg = " / ".join(f"{row[side]['tg']:.1f}" for row in data["rounds"])
        ratio = data["median_ratio_to_llama_bench"].get(side, {})
        pp_ratio = f"{ratio['pp']:.3f}" if "pp" in ratio else ("1" if side == "llama-bench" else "–")
        tg_ratio = f"{ratio['tg']:.3f}" if "tg" in ratio else "1"
        lines.append(f"| {side} | {pp} | {tg} | {pp_ratio} | {tg_ratio} |")
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == [SIDE]:  # one side of a round (see _side_in_subprocess)
        model, exact, threads, n_prompt, n_gen, seed = argv[1:7]
        side = measure_side(model, exact == "1", int(threads), int(n_prompt), int(n_gen), int(seed))
        print(json.dumps(side))
        return 0
    from specserve.tools.measure.engine_bench import resolve_model
    from specserve.tools.output import progress, write_report

    parser = engine_parser(MODULE, __doc__)
    parser.add_argument(
        "--vs-llama-bench",
        required=True,
        metavar="PATH",
        help="The llama-bench binary to compare plain decoding (pp, tg) with, rounds interleaved "
        "(--repeats rounds).",
    )
    engine_flags(parser)
    args = parse(parser, argv)
    settings = settings_of(args)
    data = compare_with_llama_bench(
        resolve_model(settings, settings.target),
        Path(args.vs_llama_bench),
        threads=threads_of(settings),
        rounds=max(args.repeats, 1),
        progress=progress,
    )
    write_report(args.output_dir, data, render_llama_peer(data, command_line(MODULE, argv)), "llama_bench")
    return 0


if __name__ == "__main__":
    sys.exit(run(MODULE, main))
