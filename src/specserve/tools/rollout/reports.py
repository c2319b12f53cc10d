"""Markdown reports of ``specserve verify`` and ``specserve evaluate`` (from their JSON reports)."""

from __future__ import annotations

from typing import Any


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def render_consistency(report: dict[str, Any]) -> str:
    greedy, sampled = report["greedy"], report["sampled"]
    out = [
        "## Speculation consistency check",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
        f"**{'PASS' if report['passed'] else 'FAIL'}** — greedy: {greedy['equal']}/{greedy['total']} "
        f"outputs equal ({report['unit']}); sampled: "
        + (
            f"Bonferroni-corrected p = {sampled['p_value']:.3g} over {sampled['tests']} chi-square tests "
            f"(fails below α = {sampled['alpha']})"
            if sampled["p_value"] is not None
            else "not run"
        )
        + ".",
        "",
        "### Greedy",
        "",
        "| workload | prompt | arm | result | first divergence | plain continues | speculative continues "
        "| logit margin |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in greedy["cases"]:
        d = case["divergence"] or {}
        result = "equal" if case["equal"] else ("error" if case["error"] else "differs")
        out.append(
            f"| {case['workload']} | {case['prompt']} | {case['arm']} | {result} | {d.get('position', '')} "
            f"| {_cell(d.get('plain_continuation'))} | {_cell(d.get('spec_continuation'))} "
            f"| {_num(d.get('logit_margin'), 4) if d else ''} |"
        )
    if sampled["cases"]:
        out += [
            "",
            "### Sampled",
            "",
            "| workload | prompt | arm | samples per arm | smallest p | plain mean log-lik "
            "| spec mean log-lik |",
            "|---|---|---|---|---|---|---|",
        ]
        for case in sampled["cases"]:
            out.append(
                f"| {case['workload']} | {case['prompt']} | {case['arm']} | {case['samples']} "
                f"| {min(case['p_values'], default=1.0):.3g} | {_num(case['plain_loglik'], 4)} "
                f"| {_num(case['spec_loglik'], 4)} |"
            )
    errors = sorted({c["error"] for c in greedy["cases"] + sampled["cases"] if c["error"]})
    out += ["", *[f"- error: {e}" for e in errors]] if errors else []
    out += ["", *[f"- {n}" for n in report["notes"]]] if report["notes"] else []
    return "\n".join(out) + "\n"


def _cell(text: str | None) -> str:
    if text is None:
        return ""
    return "`" + text.replace("|", "\\|").replace("`", "'").replace("\n", "⏎") + "`" if text else "(end)"


def render_evaluate(report: dict[str, Any]) -> str:
    out = [
        "## Speculation evaluation",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
        "Acceptance measured on these prompts with a fixed draft length per configuration (`auto`: the "
        "cost-aware policy); expected speed-up from the engine's calibrated cost model; measured speed-up "
        "is wall-clock decode tokens/s against plain decoding in the same run (noisy on a shared machine).",
        "",
        "### Summary",
        "",
        "Per drafter its best fixed draft length by expected speed-up: acceptance · mean acceptance length "
        "(MAL) · expected speed-up.",
        "",
    ]
    drafters: dict[str, list[str]] = {}
    for config in report["configurations"]:
        if config["policy"] == "fixed" and config["drafters"]:
            drafters.setdefault(config["drafters"][0], []).append(config["label"])
    out += [
        "| workload | " + " | ".join(drafters) + " | auto | recommended | flags |",
        "|---|" + "---|" * (len(drafters) + 3),
    ]
    sections = {**report["workloads"], "all workloads": report["overall"]}
    for name, data in sections.items():
        rows = data["configs"]
        cells = []
        for labels in drafters.values():
            label = max(labels, key=lambda x: rows[x]["expected_speedup"] or 0.0)
            r = rows[label]
            cells.append(
                f"{_pct(r['acceptance_rate'])} · {_num(r['mean_acceptance_length'])} · "
                f"{_num(r['expected_speedup'], 2, 'x')} ({label.split()[-1]})"
            )
        auto = rows.get("auto", {}).get("expected_speedup")
        rec = data["recommendation"]
        out.append(
            f"| {name} | " + " | ".join(cells) + f" | {_num(auto, 2, 'x')} | {rec['config']} "
            f"({_num(rec['expected_speedup'], 2, 'x')}) | `{rec['flags']}` |"
        )
    for name, data in sections.items():
        out += [
            "",
            f"### {name}",
            "",
            "| configuration | acceptance | MAL | by position (1, 2, 3, 4 …) | expected | measured |",
            "|---|---|---|---|---|---|",
        ]
        for label, r in data["configs"].items():
            positions = " ".join(f"{a:.0%}" for a in r["acceptance_by_position"][:8])
            out.append(
                f"| {label} | {_pct(r['acceptance_rate'])} | {_num(r['mean_acceptance_length'])} "
                f"| {positions} | {_num(r['expected_speedup'], 2, 'x')} "
                f"| {_num(r['measured_speedup'], 2, 'x')} |"
            )
    costs = report["costs_ms"]
    sizes = list(costs["target_ms"])
    out += ["", "Cost model (ms per decode call, by tokens in the call):", ""]
    out += ["| model | " + " | ".join(str(s) for s in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for label in ("target_ms", "draft_ms"):
        if costs.get(label):
            table = costs[label]
            out.append(f"| {label[:-3]} | " + " | ".join(_num(table[s], 1) for s in sizes) + " |")
    out += ["", *[f"- {n}" for n in report.get("notes", [])]] if report.get("notes") else []
    return "\n".join(out) + "\n"
