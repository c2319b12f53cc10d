"""What a target pass of ``n`` rows costs after ``d`` cached tokens, beside the load-time cost table.

The table (``cost_model.calibrate``) times calls after a 48-token context; a verify pass of an agent's
request runs after hundreds to thousands, and each of its rows attends to all of them. This loads the
target as ``specserve serve`` does (the same settings flags, the cached table and kernel settings) and times
calls of each size at each depth, sizes taking turns (median of ``--repeats``), on a scratch sequence.

    python -m benchmarks.depth_cost [--depths 16 512 1024 2048] [--rows 1 8 16 33] [--repeats 7]

Prints one JSON object: the table's price of each size, and per depth the measured milliseconds and their
ratio to that depth's one-row call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

from benchmarks.batch_pass import cpu_model
from specserve.config import ENGINE_GROUPS


def main(argv: Sequence[str] | None = None) -> int:
    from specserve.backends.base import DecodeChunk
    from specserve.config_sources import add_arguments, load_settings
    from specserve.engine.builder import load_models

    parser = argparse.ArgumentParser(prog="python -m benchmarks.depth_cost")
    parser.add_argument("--depths", type=int, nargs="+", default=[16, 512, 1024, 2048])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 24, 33])
    parser.add_argument("--repeats", type=int, default=7)
    add_arguments(parser, ENGINE_GROUPS)
    args = parser.parse_args(argv)
    models = load_models(load_settings(args))
    runtime, table = models.target, models.costs.target
    longest = max(args.depths) + max(args.rows)
    if longest > runtime.info.context_per_sequence:
        parser.error(f"depth + rows {longest} exceed the context per sequence")
    spread = max(runtime.info.vocab_size - 100, 1)  # ids a tiny test vocabulary holds too
    tokens = [100 + (104729 * i) % min(30000, spread) for i in range(longest)]
    scratch = 0
    result: dict[str, object] = {
        "cpu": cpu_model(),
        "exactness": runtime.info.exactness,
        "table_ms": {n: round(1000 * table(n), 1) for n in args.rows},
    }
    cached = 0
    runtime.free(scratch)
    try:
        for depth in sorted(args.depths):  # each depth extends the last one's cache, never prefills it again
            for start in range(cached, depth, 256):
                chunk = tokens[start : min(start + 256, depth)]
                runtime.decode([DecodeChunk(scratch, chunk, start, 1)])
            cached = depth
            times: dict[int, list[float]] = {n: [] for n in args.rows}
            for _ in range(args.repeats):
                for n in args.rows:
                    started = time.perf_counter()
                    runtime.decode([DecodeChunk(scratch, tokens[depth : depth + n], depth, n)])
                    runtime.synchronize()
                    times[n].append(time.perf_counter() - started)
                    runtime.truncate(scratch, depth)
            ms = {n: 1000 * statistics.median(t) for n, t in times.items()}
            one = ms[min(args.rows)]
            result[str(depth)] = {
                "ms": {n: round(v, 1) for n, v in ms.items()},
                "steps": {n: round(v / one, 2) for n, v in ms.items()},
            }
    finally:
        runtime.free(scratch)
        models.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
