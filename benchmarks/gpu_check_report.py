"""The GPU check's sections from raw timings, and its Markdown report.

Raw timings become ratios here, each against a baseline measured in the same run (a one-token step, eager
mode, the fast kernels, plain decoding): ratios carry over between runs and machines far better than
absolute figures. Keys are strings throughout, so the data reads the same before and after JSON.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_models import weight_bytes_read
from benchmarks.gpu_check_numbers import render_numbers
from benchmarks.gpu_check_serve import render_serve
from specserve.backends.torch.model import Decoder

SECTIONS = ("numbers", "plain", "verify", "oracle", "exact", "attention", "serve")


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def plain_section(
    measured: dict[str, dict[int, dict[str, float]]],
    model: Decoder,
    kv_bytes_per_token: int,
    mean_position: float,
    peak: float | None,
) -> dict[str, Any]:
    """Per mode and batch: step ms, tokens/s and, with a known peak, the share of HBM bandwidth that
    (weights + the KV the step reads) over the step time reaches."""
    weights = weight_bytes_read(model)
    modes: dict[str, dict[str, dict[str, float | None]]] = {}
    for mode, by_batch in measured.items():
        modes[mode] = {}
        for batch, m in by_batch.items():
            step_bytes = weights + batch * mean_position * kv_bytes_per_token
            achieved = step_bytes / (m["step_ms"] / 1000)
            modes[mode][str(batch)] = {
                "step_ms": round(m["step_ms"], 4),
                "tokens_per_s": round(m["tokens_per_s"], 2),
                "bytes_per_step": int(step_bytes),
                "hbm_fraction": round(achieved / peak, 4) if peak else None,
            }
    result: dict[str, Any] = {
        "weight_bytes": weights,
        "kv_bytes_per_token": kv_bytes_per_token,
        "modes": modes,
    }
    if "graphs" in modes:
        result["graphs_over_eager_tokens_per_s"] = {
            b: _ratio(modes["graphs"][b]["tokens_per_s"] or 0.0, modes["eager"][b]["tokens_per_s"] or 0.0)
            for b in modes["graphs"]
        }
    else:
        result["graphs_over_eager_tokens_per_s"] = None
        result["graphs_note"] = "CUDA graphs exist only on a CUDA device"
    return result


def verify_section(calls: dict[str, dict[int, float]]) -> dict[str, Any]:
    """One call of n rows (one sequence) against a one-token step per mode; draft step against target step."""
    targets = {k: v for k, v in calls.items() if not k.startswith("draft:")}
    result: dict[str, Any] = {
        "rows_ms": {m: {str(n): round(ms, 4) for n, ms in by_n.items()} for m, by_n in targets.items()},
        "relative_to_one_token": {
            m: {str(n): _ratio(ms, by_n[1]) for n, ms in by_n.items() if n > 1} for m, by_n in targets.items()
        },
        "draft_step_ms": {
            k.removeprefix("draft:"): round(v[1], 4) for k, v in calls.items() if k.startswith("draft:")
        },
    }
    result["draft_over_target_step"] = {
        m: _ratio(ms, targets[m][1]) for m, ms in result["draft_step_ms"].items()
    }
    if "graphs" in targets:
        result["graphs_over_eager"] = {
            str(n): _ratio(ms, targets["eager"][n]) for n, ms in targets["graphs"].items()
        }
    return result


def exact_section(verify: dict[str, Any] | None, exactness: str, note: str) -> dict[str, Any]:
    """The load-time self-check's outcome, and exact/fast cost per call size (against eager and graphs)."""
    result: dict[str, Any] = {
        "self_check": {"passed": exactness == "batch-invariant", "exactness": exactness, "note": note}
    }
    if verify is None:
        result["exact_over_fast"] = None
        result["note"] = "no call timings (the verify section failed)"
        return result
    rows = verify["rows_ms"]
    result["exact_over_fast"] = {
        fast: {n: _ratio(ms, rows[fast][n]) for n, ms in rows["exact"].items()}
        for fast in rows
        if fast != "exact"
    }
    return result


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _error(lines: list[str], entry: dict[str, Any]) -> bool:
    if "error" in entry:
        lines.append(f"failed: `{entry['error']}`\n")
        return True
    return False


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def render(data: dict[str, Any]) -> str:
    lines = [
        "# GPU check (torch runtime)\n",
        f"`{data['command']}`\n",
        f"- device: {data['device']} ({data['device_type']}); torch {data['torch']}, CUDA {data['cuda']}",
        f"- dtype: {data['dtype']}; random weights of "
        + (
            "tiny shapes (a dry run: no figure here describes a real model)"
            if data["tiny"]
            else "real shapes"
        )
        + f"; {data['date']}",
        f"- status: {data['status']}, {data.get('elapsed_seconds', 0)} s "
        f"of a {data['budget_seconds']:.0f} s budget",
        "",
    ]
    for name, shape in data["shapes"].items():
        t, d = shape["target"], shape["draft"]
        lines.append(
            f"- **{name}**: {t['family']} {t['layers']}L/{t['hidden']} heads {t['heads']} ffn {t['ffn']} "
            f"vocab {t['vocab']} ({_count(t['params'])}); "
            f"draft {d['layers']}L/{d['hidden']} ({_count(d['params'])})"
            + (f"; --compile: {_fmt(shape['compile_seconds'], 1)} s" if shape.get("compile_seconds") else "")
            + (f"; --compile failed: `{shape['compile_failed']}`" if "compile_failed" in shape else "")
        )
    for skip in data["skipped"]:
        lines.append(f"- **{skip['shape']}** skipped: {skip['why']}")
    lines += ["", *render_numbers(data)]
    lines += ["## plain\n", "One-token steps (each synchronized) after a short context.\n"]
    for name, entry in data["plain"].items():
        lines.append(f"**{name}**\n")
        if _error(lines, entry):
            continue
        lines += ["| mode | batch | step ms | tokens/s | HBM share |", "|---|---|---|---|---|"]
        for mode, by_batch in entry["modes"].items():
            for b, m in by_batch.items():
                share = _fmt(m["hbm_fraction"] * 100, 1) + " %" if m["hbm_fraction"] is not None else "n/a"
                lines.append(f"| {mode} | {b} | {m['step_ms']:.3f} | {m['tokens_per_s']:.1f} | {share} |")
        ratio = entry["graphs_over_eager_tokens_per_s"]
        captured = (
            f" ({entry['graphs_captured']} graphs captured, capture failed: {entry['graphs_failed']})"
            if "graphs_captured" in entry
            else ""
        )
        lines.append(f"\ngraphs / eager tokens/s: {_fmt(ratio) if ratio is None else ratio}{captured}\n")
        for mode, m in entry.get("new_positions_batch_1", {}).items():
            lines.append(
                f"- {mode}, batch 1 at new positions: median {m['median_step_ms']:.3f} ms, "
                f"slowest {m['slowest_step_ms']:.3f} ms"
            )
        lines.append("")
    lines += ["## verify\n", "One call of n rows of one sequence, relative to a one-token step.\n"]
    for name, entry in data["verify"].items():
        lines.append(f"**{name}**\n")
        if _error(lines, entry):
            continue
        sizes = list(next(iter(entry["relative_to_one_token"].values())))
        lines += [
            "| mode | 1 row ms | " + " | ".join(f"{n} rows" for n in sizes) + " |",
            "|---" * (len(sizes) + 2) + "|",
        ]
        for mode, rel in entry["relative_to_one_token"].items():
            cells = " | ".join(f"{rel[n]:.2f}x" for n in sizes)
            lines.append(f"| {mode} | {entry['rows_ms'][mode]['1']:.3f} | {cells} |")
        lines.append(f"\ndraft step / target step: {entry['draft_over_target_step']}")
        if "graphs_over_eager" in entry:
            lines.append(f"; graphs / eager per call: {entry['graphs_over_eager']}")
        lines.append("")
    lines += [
        "## oracle\n",
        "The engine with an oracle drafter (the target's own greedy continuation, each draft token wrong "
        "with probability 1 - α) against plain decoding in the same run.\n",
    ]
    for name, modes in data["oracle"].items():
        lines.append(f"**{name}**\n")
        if _error(lines, modes):
            continue
        lines += [
            "| kernels | policy | α | tokens/s | vs plain | ideal | MAL (expected) | identical |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, entry in modes.items():
            if "error" in entry:
                lines.append(f"| {label} | failed: `{entry['error']}` | | | | | | |")
                continue
            for run in entry["runs"]:
                lines.append(
                    f"| {label} ({entry['exactness']}) | {run['policy']} k≤{entry['num_draft_tokens']} | "
                    f"{run['alpha']} | {run['tokens_per_s']:.1f} | {_fmt(run.get('speedup'))}x | "
                    f"{_fmt(run['ideal_speedup'])} | {run['mean_acceptance_length']:.2f} "
                    f"({run['expected_acceptance_length']:.2f}) | {run['identical']} |"
                )
        for label, entry in modes.items():
            if "error" not in entry:
                lines.append(
                    f"\n{label}: plain {_fmt(entry.get('plain_tokens_per_s'), 1)} tokens/s, "
                    f"{entry['max_tokens']} tokens, distinct {entry['distinct_fraction']}, plain repeatable "
                    f"{entry.get('plain_repeatable')}" + (f"; {entry['note']}" if "note" in entry else "")
                )
                for case, waits in entry.get("host_waits", {}).items():
                    lines.append(
                        f"{label}, {case}: {waits['waits_per_step']} host waits per step over "
                        f"{waits['steps']} steps (CUDA sync debug mode; aim 1): {waits['where']}"
                    )
        lines.append("")
    lines += ["## exact\n"]
    for name, entry in data["exact"].items():
        lines.append(f"**{name}**\n")
        if _error(lines, entry):
            continue
        check = entry["self_check"]
        lines.append(f"self-check passed: {check['passed']} ({check['exactness']}: {check['note']})\n")
        for fast, by_n in (entry["exact_over_fast"] or {}).items():
            cells = ", ".join(f"{n}: {r:.2f}x" for n, r in by_n.items())
            lines.append(f"- exact / {fast} per call: {cells}")
        lines.append("")
    lines += render_serve(data)
    if data["errors"]:
        lines += ["## errors\n"] + [
            f"- {e['section']} / {e['shape']}: `{e['error']}`" for e in data["errors"]
        ]
    return "\n".join(lines) + "\n"


class Report:
    """The results so far, written to both files after every section."""

    def __init__(self, out_dir: Path, header: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.data: dict[str, Any] = {**header, "status": "running", "shapes": {}, "skipped": []}
        self.data.update({name: {} for name in SECTIONS})
        self.data["errors"] = []
        self.started = time.perf_counter()
        out_dir.mkdir(parents=True, exist_ok=True)

    def section(self, name: str, shape: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """``fn``'s result as ``data[name][shape]``; a failure is recorded there and in ``errors``."""
        try:
            result = fn()
        except Exception as exc:
            self.fail(name, shape, exc)
            return None
        self.data[name][shape] = result
        self.flush()
        return result

    def fail(self, name: str, shape: str, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"[:1000]
        self.data.setdefault(name, {})[shape] = {"error": message}
        self.data["errors"].append(
            {"section": name, "shape": shape, "error": message, "traceback": traceback.format_exc()[-3000:]}
        )
        print(f"gpu-check: {name} / {shape} failed: {message}", file=sys.stderr, flush=True)
        self.flush()

    def flush(self, status: str | None = None) -> None:
        if status is not None:
            self.data["status"] = status
        self.data["elapsed_seconds"] = round(time.perf_counter() - self.started, 1)
        try:
            markdown = render(self.data)
        except Exception as exc:  # the JSON holds everything; a rendering bug must not end the run
            markdown = f"# GPU check (torch runtime)\n\nrendering failed ({exc!r}); see gpu-check.json\n"
        for stem, text in (("json", json.dumps(self.data, indent=2, default=str)), ("md", markdown)):
            tmp = self.out_dir / f"gpu-check.{stem}.tmp"
            tmp.write_text(text)
            tmp.replace(self.out_dir / f"gpu-check.{stem}")
