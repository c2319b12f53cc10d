"""Markdown for the engine benchmark, and the cost model's answer to "what would make the draft pay"."""

from __future__ import annotations

import itertools
from typing import Any

from specserve.engine.draft_policy import expected_tokens

ALPHAS = (0.6, 0.7, 0.8, 0.9)


def best_speedup(
    target_ms: dict[int, float], draft_ms: float, alpha: float, max_k: int = 16
) -> tuple[float, int]:
    """Best expected speed-up over plain for a chain drafter of per-token cost ``draft_ms``; (speed-up, k)."""
    sizes = sorted(target_ms)

    def target(n: int) -> float:
        for lo, hi in itertools.pairwise(sizes):
            if lo <= n <= hi:
                return target_ms[lo] + (target_ms[hi] - target_ms[lo]) * (n - lo) / (hi - lo)
        return target_ms[sizes[-1]] * n / sizes[-1]

    best, best_k = 1.0, 0
    for k in range(1, max_k + 1):
        rate = expected_tokens(alpha, k) / (target(k + 1) + draft_ms * k)
        speedup = rate * target(1)
        if speedup > best:
            best, best_k = speedup, k
    return best, best_k


def what_if_rows(costs: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """Scenarios built from the measured tables: measured, trimmed draft vocab, bigger target, GPU-like."""
    target = {int(k): float(v) for k, v in costs["target_ms"].items()}
    draft_table = costs.get("draft_ms") or {}
    draft = float(draft_table.get(1, draft_table.get("1", target[1] * 0.6)))
    flat = {n: target[1] * (1 + 0.02 * (n - 1)) for n in target}  # memory-bound: k+1 positions ≈ 1 step
    scenarios = [
        ("measured here", target, draft),
        ("draft output vocab trimmed to 32k (-22% draft cost)", target, draft * 0.78),
        (
            "7B target (~4.7x the 1.5B cost per token), same draft",
            {n: v * 4.7 for n, v in target.items()},
            draft,
        ),
        ("GPU-like: verify of k+1 tokens ≈ one step, draft 10% of a step", flat, flat[1] * 0.10),
    ]
    rows = []
    for name, table, draft_ms in scenarios:
        cells = []
        for alpha in ALPHAS:
            speedup, k = best_speedup(table, draft_ms, alpha)
            cells.append(f"{speedup:.2f}x (k={k})" if k else "1.00x (plain)")
        rows.append((name, cells))
    return rows


def render_markdown(data: dict[str, Any], command: str, structured: bool = False) -> str:
    results: dict[str, dict[str, dict[str, Any]]] = data["results"]
    modes = list(next(iter(results.values())).keys()) if results else []
    out = [
        "## Engine benchmark (in-process, default pair)",
        "",
        f"Command: `{command}`",
        "",
        f"Settings: `{data['settings']}`",
        "",
        "Decode-phase tokens/s (first token excluded), ratio to plain decoding measured in the same run; "
        "acceptance = accepted / drafted tokens; MAL = mean acceptance length (1 + accepted / drafts); "
        "`same` = greedy outputs identical to plain."
        + (
            " Constrained prompts: `forced` = share of output tokens the grammar drafted and the target "
            "accepted; `valid` = outputs that parse and validate against the schema; grammar = the grammar "
            "engine's time per output token (masks of every verified row, forced tokens, commits)."
            if structured
            else ""
        ),
        "",
        "| kind | " + " | ".join(modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for kind, cells in results.items():
        plain = cells.get("plain", {}).get("tokens_per_second") or 0.0
        row = []
        for mode in modes:
            c = cells[mode]
            ratio = c["tokens_per_second"] / plain if plain else 0.0
            if mode == "plain":
                cell = f"{c['tokens_per_second']:.2f} tok/s"
            else:
                cell = (
                    f"{ratio:.2f}x · acc {c['acceptance_rate']:.0%} · MAL {c['mean_acceptance_length']:.2f}"
                    f" · same {c['identical']}/{c['runs']}"
                )
            if structured:
                cell += (
                    f" · forced {c.get('forced_share', 0):.0%} · valid {c.get('valid', 0)}/{c['runs']}"
                    f" · grammar {c.get('grammar_us_per_token', 0):.0f} µs/tok"
                )
            row.append(cell)
        out.append(f"| {kind} | " + " | ".join(row) + " |")
    costs = data["costs_ms"]
    out += ["", "Measured decode cost (ms per call, by tokens in the batch):", ""]
    sizes = list(costs["target_ms"].keys())
    out.append("| model | " + " | ".join(str(s) for s in sizes) + " |")
    out.append("|---|" + "---|" * len(sizes))
    for label in ("target_ms", "draft_ms"):
        if costs.get(label):
            out.append(f"| {label[:-3]} | " + " | ".join(f"{costs[label][s]:.1f}" for s in sizes) + " |")
    out += [
        "",
        "What would make the draft model pay — best expected speed-up over plain from the cost model "
        "(chain drafting, geometric acceptance α, best k ≤ 16):",
        "",
        "| scenario | " + " | ".join(f"α={a}" for a in ALPHAS) + " |",
        "|---|" + "---|" * len(ALPHAS),
    ]
    for name, speedups in what_if_rows(costs):
        out.append(f"| {name} | " + " | ".join(speedups) + " |")
    if data.get("notes"):
        out += ["", *[f"- {n}" for n in data["notes"]]]
    return "\n".join(out) + "\n"
