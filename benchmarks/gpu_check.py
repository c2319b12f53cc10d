"""The GPU check of the torch runtime: one bounded command that measures what a GPU session must know.

``python -m benchmarks.gpu_check --output-dir DIR [--device cuda|cpu] [--tiny]`` (or
``scripts/gpu-check.sh``) writes ``DIR/gpu-check.json`` and ``DIR/gpu-check.md``, sections:

* **plain**: one-token decode tokens/s at batch 1 and 8, the share of peak HBM bandwidth it reaches, CUDA
  graphs against eager;
* **verify**: one call of 2-16 rows against a one-token step, and a draft-model step against a target step;
* **oracle**: the real engine with an oracle drafter at chosen acceptance rates against plain decoding, and
  whether speculative output equals plain output token for token;
* **exact**: the batch-invariant kernels' cost per call against the fast ones, and the load-time self-check;
* **serve**: plain decoding through the HTTP server with 1 and 8 streaming clients against the engine alone
  (benchmarks/gpu_check_serve.py; skipped, and saying so, where the server's packages are not installed).

Why this shape: device time is scarce (minutes per task) and a machine may not come twice, so the check
needs no files (random weights of real shapes, built on the device), keeps its imports to torch and numpy,
bounds its time (``--budget-seconds`` shrinks repetitions and skips the 8B shape when short), records a
failing section instead of crashing, and rewrites both files after every section, so a run cut off still
leaves what it measured. Every speed is a ratio measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check_models import (
    SHAPES,
    TINY_SHAPES,
    Shape,
    describe,
    device_name,
    open_runtime,
    parameter_count,
    peak_bandwidth,
    random_decoder,
)
from benchmarks.gpu_check_numbers import attention_section, numbers_section
from benchmarks.gpu_check_oracle import oracle_runs
from benchmarks.gpu_check_report import (
    SECTIONS,
    Report,
    exact_section,
    plain_section,
    render,
    verify_section,
)
from benchmarks.gpu_check_serve import serve_section
from benchmarks.gpu_check_timing import (
    CallSpec,
    call_costs,
    context_tokens,
    decode_new_positions,
    decode_steps,
)
from specserve.backends.torch.runtime import TorchRuntime
from specserve.backends.torch.setup import resolve_dtype

MODES = {
    "graphs": (False, True, "auto", False),
    "eager": (False, False, "auto", False),
    "exact": (True, True, "auto", False),
    "masked": (False, False, "masked", False),
    "compiled": (False, True, "auto", True),
}
"""mode: (exact kernels, CUDA graphs, attention, --compile). "masked" is the attention before the row
kernel; "compiled" is "graphs" with the row functions through torch.compile."""
CPU_MODES = ("eager", "exact", "compiled")
ROWS = (1, 2, 4, 8, 16)
SERVE_MAX_PARAMETERS = 2e9
"""The serve section writes the target to disk for the server's engine process: the 1.5B shape only."""
BATCHES = (1, 8)


@dataclass(frozen=True)
class Plan:
    """Sizes and repetition counts of one shape's measurements."""

    context: int = 1024
    prefill: int = 128
    steps: int = 32
    blocks: int = 5
    call_reps: int = 10
    prompt_tokens: int = 64
    oracle_tokens: int = 256
    draft_tokens: int = 8
    alphas: tuple[float, ...] = (0.6, 0.8, 0.9)

    def scaled(self, factor: float) -> Plan:
        """Fewer (or more) repetitions and generated tokens; shapes and sizes stay."""
        return replace(
            self,
            steps=max(4, round(self.steps * factor)),
            blocks=max(1, round(self.blocks * factor)),
            call_reps=max(2, round(self.call_reps * factor)),
            oracle_tokens=max(24, round(self.oracle_tokens * factor)),
        )


TINY_PLAN = Plan(context=256, prefill=32, steps=8, blocks=2, call_reps=3, prompt_tokens=16, oracle_tokens=48)
DEFAULT_BUDGET = 420.0


def run_shape(shape: Shape, plan: Plan, args: argparse.Namespace, report: Report, until: float) -> None:
    """Every section on one shape, within ``until`` (``perf_counter``) as far as repetition counts allow:
    plain decoding may use a quarter of the time left, the call timings a tenth, the oracle the rest (half
    each to exact and fast kernels). Its models and runtimes are freed before returning."""
    device = torch.device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    modes = MODES if device.type == "cuda" else {m: MODES[m] for m in CPU_MODES}
    runtimes: dict[str, TorchRuntime] = {}
    drafts: dict[str, TorchRuntime] = {}
    name = shape.name
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        started = time.perf_counter()
        failed_compile: str | None = None
        target = random_decoder(shape.target, device, dtype, plan.context, seed=0)
        draft = random_decoder(shape.draft, device, dtype, plan.context, seed=1)
        for mode, (exact, graphs, attention, compile_rows) in modes.items():
            common: dict[str, Any] = {
                "device": device,
                "dtype": args.dtype,
                "exact": exact,
                "graphs": graphs,
                "attention": attention,
                "compile": compile_rows,
                "max_sequences": max(BATCHES),
                "context": plan.context,
                "threads": args.threads,
            }
            try:
                runtimes[mode] = open_runtime(name, target, **common)
                drafts[mode] = open_runtime(f"{name}-draft", draft, self_check=False, **common)
            except Exception as exc:
                if not compile_rows:
                    raise
                # torch.compile failing here (a toolchain, a Triton version) costs its mode, not the shape
                failed_compile = f"{type(exc).__name__}: {exc}"[:1000]
                for group in (runtimes, drafts):
                    if mode in group:
                        group.pop(mode).close()
        report.data["shapes"][name] = {
            "target": describe(shape.target),
            "draft": describe(shape.draft),
            "load_seconds": round(time.perf_counter() - started, 1),
            "plan": dict(vars(plan)),
        }
        if "compiled" in runtimes:
            report.data["shapes"][name]["compile_seconds"] = runtimes["compiled"].compile_seconds
        elif failed_compile is not None:
            report.data["shapes"][name]["compile_failed"] = failed_compile
    except Exception as exc:
        for section in SECTIONS:
            report.fail(section, name, exc)
        _close(runtimes, drafts)
        return

    def share(fraction: float) -> float:
        now = time.perf_counter()
        return now + fraction * max(0.0, until - now)

    peak = peak_bandwidth(device_name(device)) if device.type == "cuda" else None

    def plain() -> dict[str, Any]:
        end = share(0.25)
        measured = {
            m: {b: decode_steps(rt, b, plan.prefill, plan.steps, plan.blocks, end) for b in BATCHES}
            for m, rt in runtimes.items()
        }
        mean_position = plan.prefill + plan.steps / 2
        kv_bytes = runtimes["eager"].info.kv_bytes_per_token
        result = plain_section(measured, target, kv_bytes, mean_position, peak)
        result["new_positions_batch_1"] = {
            m: decode_new_positions(rt, plan.prefill, plan.steps) for m, rt in runtimes.items()
        }
        graphs = runtimes["graphs"].graphs if "graphs" in runtimes else None
        if graphs is not None:  # a failed capture falls back to eager: graphs/eager ~1 would mislead
            result["graphs_captured"], result["graphs_failed"] = len(graphs.graphs), graphs.failed
        return result

    report.section(
        "numbers", name, lambda: numbers_section(runtimes, plan.prompt_tokens, min(64, plan.oracle_tokens))
    )
    report.section("plain", name, plain)
    specs = [CallSpec(m, rt, ROWS) for m, rt in runtimes.items()]
    specs += [CallSpec(f"draft:{m}", rt, (1,)) for m, rt in drafts.items()]
    calls = report.section(
        "verify", name, lambda: verify_section(call_costs(specs, plan.prefill, plan.call_reps, share(0.15)))
    )
    report.section("attention", name, lambda: attention_section(runtimes, plan.prefill))
    exact_rt = runtimes["exact"]
    info = exact_rt.info
    report.section("exact", name, lambda: exact_section(calls, info.exactness, info.exactness_note))
    fast = runtimes["graphs" if "graphs" in runtimes else "eager"]
    oracle: dict[str, Any] = {}
    for label, rt, fraction in (("exact", exact_rt, 0.5), ("fast", fast, 0.95)):
        try:
            oracle[label] = oracle_runs(
                rt,
                prompt_tokens=plan.prompt_tokens,
                max_tokens=plan.oracle_tokens,
                alphas=plan.alphas,
                num_draft_tokens=plan.draft_tokens,
                deadline=share(fraction),
            )
        except Exception as exc:
            report.fail("oracle", name, exc)
            oracle[label] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        report.data["oracle"][name] = dict(oracle)
        report.flush()
    if parameter_count(shape.target) <= SERVE_MAX_PARAMETERS:
        prompt = context_tokens(shape.target.vocab_size, plan.prompt_tokens, seed=3)
        report.section(
            "serve", name, lambda: serve_section(exact_rt, target, prompt, plan.oracle_tokens, args.threads)
        )
    else:
        report.data["serve"][name] = {
            "skipped": "the 1.5B shape stands for the host path (a checkpoint "
            "of this one would take tens of GB and minutes to write and load)"
        }
    if device.type == "cuda":
        report.data["shapes"][name]["peak_memory_gib"] = round(
            torch.cuda.max_memory_allocated(device) / 2**30, 2
        )
    _close(runtimes, drafts)


def _close(*groups: dict[str, TorchRuntime]) -> None:
    for group in groups:
        for rt in group.values():
            rt.close()
        group.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def memory_short(shape: Shape, plan: Plan, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why ``shape`` would not fit in free device memory (weights, a KV cache per mode and model, graph
    pools and activations as a 6 GiB margin), or None."""
    if device.type != "cuda":
        return None
    need = (parameter_count(shape.target) + parameter_count(shape.draft)) * dtype.itemsize
    for cfg in (shape.target, shape.draft):
        kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        need += len(MODES) * kv * (max(BATCHES) + 1) * plan.context
    need += 6 << 30
    free, _ = torch.cuda.mem_get_info(device)
    return None if free >= need else f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny: the dry run)")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on a GPU, float32 on the CPU")
    parser.add_argument("--tiny", action="store_true", help="small shapes: a CPU dry run in seconds")
    parser.add_argument("--budget-seconds", type=float, default=DEFAULT_BUDGET)
    parser.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    deadline = start + args.budget_seconds
    device = torch.device(args.device)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        wanted = set(args.shapes.split(","))
        unknown = wanted - {s.name for s in shapes}
        if unknown:
            known = ", ".join(s.name for s in shapes)
            raise SystemExit(f"gpu-check: unknown shape {', '.join(sorted(unknown))} (known: {known})")
        shapes = tuple(s for s in shapes if s.name in wanted)
    base = TINY_PLAN if args.tiny else Plan()
    plan = base.scaled(min(3.0, max(0.2, args.budget_seconds / DEFAULT_BUDGET)))
    dtype = resolve_dtype(args.dtype, device)
    command = os.environ.get("GPU_CHECK_COMMAND") or shlex.join(
        [sys.executable, "-m", "benchmarks.gpu_check", *(sys.argv[1:] if argv is None else argv)]
    )
    report = Report(
        args.output_dir,
        {
            "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "device": device_name(device),
            "device_type": device.type,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "dtype": str(dtype).removeprefix("torch."),
            "budget_seconds": args.budget_seconds,
            "tiny": args.tiny,
            "peak_bandwidth_bytes_per_s": peak_bandwidth(device_name(device))
            if device.type == "cuda"
            else None,
        },
    )
    report.flush()
    if device.type == "cuda" and not torch.cuda.is_available():  # not silently a CPU run of 8B shapes
        report.data["errors"].append({"section": "setup", "shape": "-", "error": "torch sees no CUDA device"})
        report.flush("failed")
        print("gpu-check: torch sees no CUDA device (--device cpu --tiny for a dry run)", file=sys.stderr)
        return 2
    first_seconds = 0.0
    for index, shape in enumerate(shapes):
        now = time.perf_counter()
        shape_plan, why = plan, memory_short(shape, plan, device, dtype)
        if index and why is None:
            estimate = 1.5 * first_seconds  # a bigger model: the same step counts, slower steps
            fraction = (deadline - now) / estimate if estimate else 1.0
            if fraction < 0.35:
                why = f"{deadline - now:.0f} s of the budget left, ~{estimate:.0f} s needed"
            else:
                shape_plan = plan.scaled(min(1.0, fraction))
        if why is not None:
            report.data["skipped"].append({"shape": shape.name, "why": why})
            report.flush()
            continue
        # The first of several shapes gets about half of the budget, the last whatever is left.
        until = deadline if index == len(shapes) - 1 else now + 0.5 * (deadline - now)
        try:
            run_shape(shape, shape_plan, args, report, until)
        except Exception as exc:  # past the sections (freeing memory after a CUDA error): the next shape
            report.fail("setup", shape.name, exc)
        if not index:
            first_seconds = time.perf_counter() - now
    report.flush("complete")
    print(render(report.data))
    return 1 if report.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
