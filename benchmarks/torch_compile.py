"""What ``--compile`` costs at load and saves per call: the torch runtime on the default target, eager and
compiled, fast and exact kernels.

    python -m benchmarks.torch_compile [--model PATH] [--threads N] [--repeats 5] [--output FILE]

Each arm loads the target in this process (float32: the CPU's dtype without AVX-512 BF16; the self-check
skipped, it is the same in both arms), decodes a 48-token context, then times calls of 1 and 8 rows after
it (median of ``--repeats``). Prints one JSON line per arm: load seconds, ``compile_seconds`` and ms per
call. On a GPU the GPU check's ``compiled`` mode measures the same with CUDA graphs (gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.batch_pass import cpu_model


def arm(path: str, exact: bool, compile_rows: bool, threads: int, repeats: int) -> dict[str, Any]:
    from specserve.backends.base import DecodeChunk
    from specserve.backends.torch.runtime import TorchRuntime

    started = time.perf_counter()
    runtime = TorchRuntime(
        path, context_per_sequence=256, n_threads=threads, exact=exact, dtype="float32",
        compile=compile_rows, self_check=False,
    )  # fmt: skip
    row: dict[str, Any] = {"exact": exact, "compile": compile_rows}
    row["load_seconds"] = round(time.perf_counter() - started, 1)
    row["compile_seconds"] = None if runtime.compile_seconds is None else round(runtime.compile_seconds, 1)
    vocab = runtime.info.vocab_size
    try:
        runtime.decode([DecodeChunk(0, [(1000 + i) % vocab for i in range(48)], 0, 1)])
        for rows in (1, 8):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                runtime.decode([DecodeChunk(0, [(2000 + i) % vocab for i in range(rows)], 48, rows)])
                times.append(time.perf_counter() - start)
                runtime.truncate(0, 48)
            row[f"ms_{rows}_rows"] = round(1000 * statistics.median(times), 1)
    finally:
        runtime.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a GGUF or checkpoint directory (default: the default target)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    path = args.model
    if path is None:
        from specserve.models import CATALOG, DEFAULT_TARGET, ModelStore

        located = ModelStore().locate(CATALOG[DEFAULT_TARGET])
        if located is None:
            raise SystemExit("the default target is not pulled (specserve models pull)")
        path = str(located)
    rows = [{"cpu": cpu_model(), "model": path, "threads": args.threads}]
    for exact in (False, True):
        for compile_rows in (False, True):
            rows.append(arm(path, exact, compile_rows, args.threads, args.repeats))
            print(json.dumps(rows[-1]), flush=True)
    if args.output is not None:
        args.output.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
