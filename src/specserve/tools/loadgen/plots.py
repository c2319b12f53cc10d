"""PNG figures of an HTTP benchmark report (matplotlib, Agg backend: no display needed).

Every figure is drawn from ``report.json`` alone, so a report can be re-plotted later::

    python -c "import json,sys; from specserve.tools.loadgen.plots import write_plots; \
write_plots(json.load(open(sys.argv[1])), sys.argv[2])" report.json out/
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from specserve.tools.loadgen.report import baseline_mode

LINESTYLES = {50: "-", 90: "--", 99: ":"}


def write_plots(report: dict[str, Any], directory: str | Path) -> list[Path]:
    out = Path(directory)
    figures = {
        "speedup_by_workload.png": speedup_by_workload(report),
        "latency_by_concurrency.png": latency_by_level(report),
        "acceptance_by_position.png": acceptance_by_position(report),
    }
    paths = []
    for name, figure in figures.items():
        figure.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(figure)
        paths.append(out / name)
    return paths


def _level_label(report: dict[str, Any], level: Any) -> str:
    return f"c={level}" if report["level"] == "concurrency" else f"{level:g} req/s"


def speedup_by_workload(report: dict[str, Any]) -> Figure:
    """Grouped bars: per workload, tokens/s p50 of each mode over the baseline, one bar per level."""
    key = report["level"]
    rows = report["comparisons"]
    figure, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(report["workloads"]) + 2), 4.2))
    if not rows:  # one mode only: absolute speeds
        return _absolute_speeds(report, figure, ax)
    workloads = [*report["workloads"], "all"]
    series = sorted({(c["mode"], c[key]) for c in rows}, key=lambda s: (s[0], s[1]))
    width = 0.8 / len(series)
    index = {(c["workload"], c["mode"], c[key]): c["speedup_tokens_per_second_p50"] for c in rows}
    for i, (mode, level) in enumerate(series):
        xs = [w + (i - (len(series) - 1) / 2) * width for w in range(len(workloads))]
        ys = [index.get((w, mode, level)) or 0.0 for w in workloads]
        ax.bar(xs, ys, width, label=f"{mode} {_level_label(report, level)}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(workloads)), workloads, rotation=20, ha="right")
    ax.set_ylabel(f"tokens/s p50 ÷ {baseline_mode(report['modes'])}")
    ax.set_title("Speed-up by workload (per-request decode tokens/s)")
    ax.legend(fontsize="small")
    return figure


def _absolute_speeds(report: dict[str, Any], figure: Figure, ax: Axes) -> Figure:
    key = report["level"]
    levels = sorted({r[key] for r in report["records"]})
    workloads = report["workloads"]
    width = 0.8 / max(len(levels), 1)
    for i, level in enumerate(levels):
        rec = {r["workload"]: r for r in report["records"] if r[key] == level}
        xs = [w + (i - (len(levels) - 1) / 2) * width for w in range(len(workloads))]
        ax.bar(xs, [rec[w]["tokens_per_second_p50"] or 0.0 for w in workloads], width, label=str(level))
    ax.set_xticks(range(len(workloads)), workloads, rotation=20, ha="right")
    ax.set_ylabel("tokens/s p50")
    ax.set_title(f"Tokens/s by workload (mode {report['modes'][0]}; no baseline mode measured)")
    ax.legend(title=key, fontsize="small")
    return figure


def latency_by_level(report: dict[str, Any]) -> Figure:
    """TTFT, TPOT and ITL percentiles against concurrency (or rate), all workloads together, per mode."""
    key = report["level"]
    figure, axes = plt.subplots(1, 3, figsize=(13, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric, title in zip(
        axes,
        ("ttft", "tpot", "itl"),
        ("time to first token", "time per output token", "inter-token"),
        strict=True,
    ):
        for m, mode in enumerate(report["modes"]):
            rows = sorted((r for r in report["overall"] if r["mode"] == mode), key=lambda r: r[key])
            for q, style in LINESTYLES.items():
                points = [(r[key], r[f"{metric}_p{q}"]) for r in rows if r[f"{metric}_p{q}"] is not None]
                if points:
                    xs, ys = zip(*points, strict=True)
                    label = f"{mode} p{q}"
                    ax.plot(xs, ys, style, marker="o", color=colors[m % len(colors)], label=label)
        ax.set_xlabel(key if key == "concurrency" else "requests/s per mode")
        ax.set_ylabel("ms")
        ax.set_title(title)
        levels = sorted({r[key] for r in report["overall"]})
        if key == "concurrency":
            ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{v:g}" for v in levels])
        ax.minorticks_off()
    axes[0].legend(fontsize="x-small")
    figure.suptitle("Latency percentiles (all workloads)")
    figure.tight_layout()
    return figure


def acceptance_by_position(report: dict[str, Any]) -> Figure:
    """Fraction of drafts whose i-th token was accepted (accepted_per_position / num_drafts), per workload."""
    figure, ax = plt.subplots(figsize=(6.5, 4.2))
    key = report["level"]
    drawn = False
    for workload in report["workloads"]:
        for mode in report["modes"]:
            drafts, accepted = 0, list[int]()
            for r in report["records"]:
                if r["workload"] != workload or r["mode"] != mode or not r["accepted_per_position"]:
                    continue
                drafts += r["num_drafts"] or 0
                positions = r["accepted_per_position"]
                accepted += [0] * (len(positions) - len(accepted))
                for i, n in enumerate(positions):
                    accepted[i] += n
            if drafts and accepted:
                xs = range(1, len(accepted) + 1)
                ax.plot(xs, [a / drafts for a in accepted], marker="o", label=f"{workload} ({mode})")
                drawn = True
    if drawn:
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted / drafts")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize="small")
    else:
        rates = [
            f"{r['workload']} {r['mode']} {_level_label(report, r[key])}: {r['acceptance_rate']:.0%}"
            for r in report["records"]
            if r["acceptance_rate"] is not None
        ]
        text = "The server reports no per-position acceptance."
        if rates:
            text += "\nOverall acceptance rate:\n" + "\n".join(rates[:12])
        ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, transform=ax.transAxes)
        ax.set_axis_off()
    ax.set_title("Acceptance by draft position")
    return figure
