"""What a target pass of ``n`` rows costs after ``d`` cached tokens, beside the load-time cost table.

The table (``cost_model.calibrate``) times calls after a 48-token context; a verify pass of an agent's
request runs after hundreds to thousands, and each of its rows attends to all of them. This loads the
target as ``specserve serve`` does (the same settings flags, the cached table and kernel settings) and times
calls of each size at each depth, sizes taking turns (median of ``--repeats``), on a scratch sequence.

``--flash-attention-ab`` loads the target twice, with llama.cpp's flash attention on and off, and the two
take turns call by call, swapping places each round (a slow phase of a shared VM then falls on both),
prompt pieces included.

    python -m benchmarks.depth_cost [--depths 16 512 1024 2048] [--rows 1 8 16 33] [--repeats 7]
        [--flash-attn on|off | --flash-attention-ab]

Prints one JSON object: per arm, the table's price of each size and per depth the measured milliseconds,
their ratio to that depth's one-row call, and the prompt's speed from the last depth to this one (chunks of
256 tokens). One arm: its fields at the top level.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.batch_pass import cpu_model
from specserve.config import ENGINE_GROUPS, FlashAttentionChoice

PROMPT_PIECE = 256


def main(argv: Sequence[str] | None = None) -> int:
    from specserve.config_sources import add_arguments, load_settings
    from specserve.engine.builder import load_models

    parser = argparse.ArgumentParser(prog="python -m benchmarks.depth_cost")
    parser.add_argument("--depths", type=int, nargs="+", default=[16, 512, 1024, 2048])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 33])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--flash-attention-ab", action="store_true", help="flash attention on and off, in turn"
    )
    add_arguments(parser, ENGINE_GROUPS)
    args = parser.parse_args(argv)
    settings = load_settings(args)
    both: list[FlashAttentionChoice] = ["on", "off"]
    choices = both if args.flash_attention_ab else [settings.flash_attention]
    arms = {c: load_models(dataclasses.replace(settings, flash_attention=c)) for c in choices}
    try:
        runtimes: dict[str, Any] = {c: models.target for c, models in arms.items()}
        longest = max(args.depths) + max(args.rows)
        if any(longest > r.info.context_per_sequence for r in runtimes.values()):
            parser.error(f"depth + rows {longest} exceed the context per sequence")
        results = measure(runtimes, args.depths, args.rows, args.repeats)
        for choice, models in arms.items():
            results[choice]["table_ms"] = {n: round(1000 * models.costs.target(n), 1) for n in args.rows}
    finally:
        for models in arms.values():
            models.close()
    head: dict[str, Any] = {"cpu": cpu_model(), "exactness": runtimes[choices[0]].info.exactness}
    print(json.dumps(head | (results[choices[0]] if len(choices) == 1 else {"flash_attention": results})))
    return 0


def measure(
    runtimes: dict[str, Any], depths: Sequence[int], rows: Sequence[int], repeats: int
) -> dict[str, dict[str, Any]]:
    """Per runtime (taking turns), per depth: median ms per size, steps, and the prompt's tokens/s."""
    from specserve.backends.base import DecodeChunk

    some = next(iter(runtimes.values()))
    spread = max(some.info.vocab_size - 100, 1)  # ids a tiny test vocabulary holds too
    tokens = [100 + (104729 * i) % min(30000, spread) for i in range(max(depths) + max(rows))]
    scratch = 0
    out: dict[str, dict[str, Any]] = {name: {} for name in runtimes}

    def timed(runtime: Any, chunk: DecodeChunk) -> float:
        started = time.perf_counter()
        runtime.decode([chunk])
        runtime.synchronize()
        return time.perf_counter() - started

    for runtime in runtimes.values():
        runtime.free(scratch)
    cached = 0
    try:
        for depth in sorted(depths):  # each depth extends the last one's cache, never prefills it again
            prefill = dict.fromkeys(runtimes, 0.0)
            for start in range(cached, depth, PROMPT_PIECE):
                piece = DecodeChunk(scratch, tokens[start : min(start + PROMPT_PIECE, depth)], start, 1)
                for name, runtime in runtimes.items():
                    prefill[name] += timed(runtime, piece)
            times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in runtimes}
            for repeat in range(repeats):
                for n in rows:
                    # the arms swap places each round: none always runs right after the other
                    for name, runtime in list(runtimes.items())[:: 1 if repeat % 2 == 0 else -1]:
                        times[name][n].append(
                            timed(runtime, DecodeChunk(scratch, tokens[depth : depth + n], depth, n))
                        )
                        runtime.truncate(scratch, depth)
            for name in runtimes:
                ms = {n: 1000 * statistics.median(t) for n, t in times[name].items()}
                one = ms[min(rows)]
                out[name][str(depth)] = {
                    "ms": {n: round(v, 1) for n, v in ms.items()},
                    "steps": {n: round(v / one, 2) for n, v in ms.items()},
                    "prefill_tokens_per_s": round((depth - cached) / prefill[name], 1)
                    if prefill[name]
                    else None,
                }
            cached = depth
    finally:
        for runtime in runtimes.values():
            runtime.free(scratch)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
