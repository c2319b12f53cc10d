"""What the host path costs, measured where the model costs nothing (issue 33's table).

    .venv/bin/python -m benchmarks.host_overhead [--llama-server BIN] [--sections steps,streams]
        [--batches 1 8 32] [--draft-tokens 0 8] [--streams 1 8] [--tokens 256] [--repeats 5]
        [--thread-mode] [--baseline-src CHECKOUT/src] [--output-dir DIR]

``steps``: µs of host time per engine step (benchmarks/host_steps.py), phase by phase, at each batch size,
plain and with all-accepted n-gram drafts, on the null runtime (151,936-wide fixed logits, numpy and a torch
tensor when torch is installed) and on the tiny GGUF (tests/support/tiny_models.py's 2-layer target
through llama.cpp, one thread). ``streams``: streamed tokens/s and CPU µs per token of specserve's server
and, with ``--llama-server``, stock llama-server on the same tiny GGUF, both up and measured in
alternation, ``--repeats`` rounds, the median kept, and against llama-server the median of the rounds'
paired ratios (benchmarks/host_stream.py).
Writes ``host-overhead.json`` and ``host-overhead.md`` to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import host_steps, host_stream

REPO = Path(__file__).resolve().parent.parent


def cpu_facts() -> str:
    """The CPU as a figure's reader needs it: model name, family/model, the widest vector extension."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    flags = fields.get("flags", "").split()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    family = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    return f"{fields.get('model name', '?')} ({family}, {isa}, {fields.get('siblings', '?')} CPUs)"


def tiny_model(directory: Path) -> Path:
    """The test suite's tiny target, written once into ``directory``."""
    sys.path.insert(0, str(REPO / "tests"))  # the writer lives with the tests it was made for
    from support.tiny_models import tiny_model_set

    return Path(tiny_model_set(directory, close=False).target)


def runtimes(model: Path, max_sequences: int) -> tuple[list[tuple[str, Any]], list[int]]:
    """The null runtimes and the tiny GGUF's, and the prompt: 4 rounds of the null runtimes' cycle."""
    from benchmarks.null_runtime import NullRuntime
    from specserve.backends.llama_cpp import LlamaCppRuntime

    tiny = LlamaCppRuntime(
        str(model),
        context_per_sequence=4096,
        max_sequences=max_sequences,
        n_threads=1,
        exact=False,
        batch_capacity=1024,
        self_check=False,
    )
    cycle = list(
        dict.fromkeys(tiny.tokenize(host_stream.PROMPT * 2 + " the quick brown fox", add_special=False))
    )
    made: list[tuple[str, Any]] = [("null-numpy", NullRuntime(tiny, cycle, max_sequences=max_sequences))]
    try:
        import torch  # noqa: F401

        made.append(("null-torch", NullRuntime(tiny, cycle, max_sequences=max_sequences, torch=True)))
    except ImportError:
        pass
    made.append(("tiny-llama.cpp", tiny))
    return made, cycle * 4


def step_rows(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    rows = []
    made, prompt = runtimes(model, max(args.batches))
    for name, runtime in made:
        for batch in args.batches:
            for k in args.draft_tokens:
                if name == "tiny-llama.cpp" and batch * (k + 1) > 1024:
                    continue
                times = host_steps.measure(runtime, name, batch, k, prompt, steps=args.steps)
                rows.append(times.row())
                print(json.dumps(rows[-1]), flush=True)
    made[-1][1].close()
    return rows


def stream_rows(args: argparse.Namespace, model: Path, out: Path) -> list[dict[str, Any]]:
    """Both servers up at once (an idle one costs nothing), measured in alternation, ``--repeats`` rounds;
    each row is the round with the median tokens/s."""
    slots = max(args.streams)
    servers = [host_stream.specserve_server(model, slots, out / "specserve.log")]
    try:
        if args.thread_mode:
            log = out / "specserve-thread.log"
            servers.append(
                host_stream.specserve_server(model, slots, log, "specserve-thread", ("--no-engine-process",))
            )
        if args.baseline_src:
            log, src = out / "baseline.log", Path(args.baseline_src)
            servers.append(host_stream.specserve_server(model, slots, log, "baseline", src=src))
        if args.llama_server:
            binary = Path(args.llama_server)
            servers.append(host_stream.llama_server(binary, model, slots, 4096, out / "llama-server.log"))
        rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for _ in range(args.repeats):
            for streams in args.streams:
                for server in servers:
                    row = host_stream.measure(server, "tiny-target", streams, args.tokens)
                    rounds.setdefault((server.name, streams), []).append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for server in servers:
            server.stop()
    rows = []
    for (name, streams), measured in rounds.items():
        ranked = sorted(measured, key=lambda r: r["tokens_per_s"])
        row = {**ranked[len(ranked) // 2], "rounds": [r["tokens_per_s"] for r in measured]}
        peer = rounds.get(("llama-server", streams))
        if peer is not None and name != "llama-server":
            row["vs_llama_server"] = paired_ratio(row["rounds"], [r["tokens_per_s"] for r in peer])
        rows.append(row)
    return rows


def paired_ratio(ours: list[float], peer: list[float]) -> dict[str, float]:
    """Our tokens/s over the peer's, round by round (the two stream one after the other in each round):
    the median and quartiles of those ratios. This VM's speed moves between rounds (one stream: 4,200 to
    9,000 tok/s for llama-server in seven rounds), and a ratio of two medians taken from different rounds
    carries that drift; a round's two measurements share it."""
    ratios = sorted(a / b for a, b in zip(ours, peer, strict=True) if b > 0)
    if not ratios:
        return {}
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {"median": round(quartiles[1], 3), "q1": round(quartiles[0], 3), "q3": round(quartiles[2], 3)}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"CPU: {report['cpu']}", ""]
    if report["steps"]:
        cols = ["runtime", "batch", "draft_tokens", "tokens_per_step", "host_us", "host_us_per_token"]
        cols += [f"{p}_us" for p in host_steps.PHASES]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in report["steps"]]
        lines.append("")
    if report["streams"]:
        cols = ["server", "streams", "tokens_per_s", "vs_llama_server", "process_cpu_us_per_token"]
        cols += ["event_loop_cpu_us_per_token", "engine_cpu_us_per_token", "rounds"]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in report["streams"]]
        lines += ["", "vs_llama_server: the median of the rounds' paired ratios (quartiles)."]
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if isinstance(value, dict) and "median" in value:
        return f"{value['median']:.2f}x ({value['q1']:.2f}-{value['q3']:.2f})"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sections", default="steps,streams")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="Rounds of the streams (the median is kept).")
    parser.add_argument("--llama-server", default=None, help="Stock llama-server binary to stream beside.")
    parser.add_argument(
        "--thread-mode", action="store_true", help="Also stream specserve with the engine on a thread."
    )
    parser.add_argument(
        "--baseline-src", default=None, help="Another checkout's src/ to stream as 'baseline' (before/after)."
    )
    parser.add_argument("--output-dir", default="bench-out")
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = tiny_model(Path(tempfile.mkdtemp(prefix="host-overhead-")))  # not beside the report
    sections = set(args.sections.split(","))
    report: dict[str, Any] = {
        "cpu": cpu_facts(),
        "command": " ".join(["python -m benchmarks.host_overhead", *(argv or sys.argv[1:])]),
        "steps": step_rows(args, model) if "steps" in sections else [],
        "streams": stream_rows(args, model, out) if "streams" in sections else [],
    }
    (out / "host-overhead.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "host-overhead.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
