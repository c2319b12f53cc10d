"""What one target pass costs when N sequences each decode one row, beside one sequence alone.

The load-time cost table prices a pass by its rows, measured as one sequence's chunk; at concurrency N the
rows belong to N sequences (one KV stream each, backends/llama_cpp.py), which may cost more. This measures
it in process, plain decoding, short prompts: per N, the median pass (``engine.last_pass``) over the steps
where every sequence decoded exactly one row, and the table's price of that many rows at load (one
sequence's chunk) and after the run (the engine refines it with every pass it observes).

    python -m benchmarks.batch_pass [--sequences 1 4] [--max-tokens 64] [--exact | --no-exact]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path

from specserve.config import ENGINE_GROUPS

PROMPTS = [
    "Write a poem about the sea.",
    "Explain TCP.",
    "List five fruits and why.",
    "Describe a cat.",
    "Summarise the plot of Hamlet.",
    "What is a hash map?",
    "Give three tips for sleeping well.",
    "Explain recursion to a child.",
]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: Sequence[str] | None = None) -> int:
    from specserve.chat import chat_prompt_ids
    from specserve.config_sources import add_arguments, load_settings
    from specserve.engine.builder import build_engine
    from specserve.request import SamplingParams
    from specserve.sequence import SequenceStatus, SpeculationOptions

    parser = argparse.ArgumentParser(prog="python -m benchmarks.batch_pass")
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    add_arguments(parser, ENGINE_GROUPS)
    args = parser.parse_args(argv)
    if max(args.sequences) > len(PROMPTS):
        parser.error(f"at most {len(PROMPTS)} sequences")
    settings = dataclasses.replace(load_settings(args), max_running=max(args.sequences))
    engine, _ = build_engine(settings)
    result: dict[str, object] = {"cpu": cpu_model(), "exact": settings.exact}
    at_load = {n: 1e3 * engine.costs.target(n) for n in args.sequences}  # before any pass refines it
    try:
        for n in args.sequences:
            seqs = []
            for i, text in enumerate(PROMPTS[:n]):
                prompt = chat_prompt_ids(engine.target, [{"role": "user", "content": text}])
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
                # Each its own tenant: no prefix-cache or suffix-cache help between runs.
                plain = SpeculationOptions(drafter="none")
                seqs.append(engine.add_request(f"{n}-{i}", prompt, params, plain, f"{n}-{i}"))
            passes: list[float] = []
            while engine.has_work():
                decoding = all(seq.output_ids and seq.status is SequenceStatus.RUNNING for seq in seqs)
                engine.step()
                if decoding and engine.last_pass.rows == n:  # one row each, no prompt chunk beside them
                    passes.append(engine.last_pass.seconds)
            result[str(n)] = {
                "steps": len(passes),
                "pass_ms_median": 1e3 * statistics.median(passes) if passes else None,
                "table_ms_at_load": at_load[n],
                "table_ms_after": 1e3 * engine.costs.target(n),
            }
    finally:
        engine.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
