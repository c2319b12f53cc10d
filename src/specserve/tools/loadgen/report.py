"""``report.json`` and ``report.md`` of the HTTP benchmark.

``report.json``: ``records``, one per workload × mode × level (concurrency or rate) with the contract keys
(``tokens_per_second_p50``, ``ttft_p50/p90/p99``, ``tpot_…``, ``itl_…``, ``throughput_tokens_per_second``,
``acceptance_rate``, ``mean_acceptance_length``, ``accepted_per_position``, ``requests``, ``errors``);
``overall``, the same per mode × level over all workloads; ``comparisons``, the speed-up of every mode over
the baseline (``off`` when measured) per workload and level. Latencies are milliseconds.

Speculation figures come from the servers' ``speculative`` response objects, summed over the requests,
and per-position acceptance (or everything, for a peer such as vLLM) from the servers' ``/metrics``
counters over the cell (``speculation_source`` says which); null where nothing was drafted or reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import numpy as np

from specserve.tools.loadgen.client import RequestResult
from specserve.tools.loadgen.runner import CellRun, LoadRun

PERCENTILES = (50, 90, 99)
UNITS = {
    "ttft": "ms",
    "tpot": "ms",
    "itl": "ms",
    "latency": "ms",
    "tokens_per_second": "tokens/s per request (decode phase)",
    "throughput_tokens_per_second": "output tokens/s of all requests of the cell",
}


def _pct(values: list[float], name: str) -> dict[str, float | None]:
    array = np.array(values, dtype=np.float64) * 1000.0
    return {
        f"{name}_p{q}": round(float(np.percentile(array, q)), 3) if array.size else None for q in PERCENTILES
    }


def speculation_totals(results: Iterable[RequestResult]) -> dict[str, Any]:
    """Sum of the requests' ``speculative`` objects (vLLM's names); rates from the sums."""
    reported = [r.speculative for r in results if r.speculative is not None]
    drafts = sum(int(s.get("num_drafts", 0)) for s in reported)
    draft_tokens = sum(int(s.get("num_draft_tokens", 0)) for s in reported)
    accepted = sum(int(s.get("num_accepted_tokens", 0)) for s in reported)
    per_position: list[int] | None = None
    for s in reported:
        positions = s.get("accepted_per_position")
        if isinstance(positions, list):
            per_position = per_position or []
            per_position += [0] * (len(positions) - len(per_position))
            for i, n in enumerate(positions):
                per_position[i] += int(n)
    return {
        "reported": bool(reported),
        "num_drafts": drafts if reported else None,
        "num_draft_tokens": draft_tokens if reported else None,
        "num_accepted_tokens": accepted if reported else None,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 4) if drafts else None,
        "accepted_per_position": per_position,
    }


def cell_record(cell: CellRun) -> dict[str, Any]:
    ok = [r for r in cell.results if r.error is None]
    speeds = [s for r in ok if (s := r.tokens_per_second) is not None]
    tokens = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in cell.results if r.error is not None})
    spec = _with_counters(speculation_totals(ok), cell)
    return {
        "requests": len(cell.results),
        "errors": len(cell.results) - len(ok),
        "output_tokens": tokens,
        "tokens_per_second_p50": round(statistics.median(speeds), 3) if speeds else None,
        "tokens_per_second_mean": round(statistics.fmean(speeds), 3) if speeds else None,
        **_pct([r.ttft for r in ok if r.ttft is not None], "ttft"),
        **_pct([t for r in ok if (t := r.tpot) is not None], "tpot"),
        **_pct([x for r in ok for x in r.itls], "itl"),
        **_pct([r.latency for r in ok], "latency"),
        "throughput_tokens_per_second": round(tokens / cell.seconds, 3) if cell.seconds > 0 else None,
        "duration_s": round(cell.seconds, 3),
        **spec,
        "error_messages": errors[:3],
    }


def _with_counters(spec: dict[str, Any], cell: CellRun) -> dict[str, Any]:
    """Fill in what the responses lack from the server's /metrics counters over the cell."""
    sources = ["responses"] if spec.pop("reported") else []
    counters = cell.counters
    if counters is not None and counters.num_drafts > 0:
        if not sources:
            drafts, drafted = int(counters.num_drafts), int(counters.num_draft_tokens)
            accepted = int(counters.num_accepted_tokens)
            spec |= {
                "num_drafts": drafts,
                "num_draft_tokens": drafted,
                "num_accepted_tokens": accepted,
                "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
                "mean_acceptance_length": round(1 + accepted / drafts, 4),
            }
        if spec["accepted_per_position"] is None and counters.accepted_per_position:
            spec["accepted_per_position"] = counters.per_position()
        sources.append("metrics")
    spec["speculation_source"] = "+".join(sources) or None
    return spec


def build_report(run: LoadRun, meta: dict[str, Any]) -> dict[str, Any]:
    plan = run.plan
    level_key = plan.level_name
    modes = [t.mode for t in plan.targets]
    records = []
    for level in plan.levels:
        for workload in plan.workloads:
            for mode in modes:
                cell = run.cells.get((workload.name, mode, level), CellRun())
                records.append(_labelled(workload.name, mode, level_key, level, cell_record(cell)))
    overall = []
    for level in plan.levels:
        for mode in modes:
            merged = CellRun()
            for workload in plan.workloads:
                cell = run.cells.get((workload.name, mode, level), CellRun())
                merged.results += cell.results
                merged.seconds += cell.seconds  # workloads run one after another
                if cell.counters is not None:
                    merged.add_counters(cell.counters)
            overall.append(_labelled("all", mode, level_key, level, cell_record(merged)))
    return {
        **meta,
        "level": level_key,
        "modes": modes,
        "workloads": [w.name for w in plan.workloads],
        "units": UNITS,
        "records": records,
        "overall": overall,
        "comparisons": comparisons(records + overall, modes, level_key),
        "duration_s": round(run.seconds, 3),
    }


def _labelled(workload: str, mode: str, key: str, level: float, record: dict[str, Any]) -> dict[str, Any]:
    return {
        "workload": workload,
        "mode": mode,
        "concurrency": int(level) if key == "concurrency" else None,
        "rate": level if key == "rate" else None,
        **record,
    }


def baseline_mode(modes: list[str]) -> str:
    return "off" if "off" in modes else modes[0]


def comparisons(records: list[dict[str, Any]], modes: list[str], level_key: str) -> list[dict[str, Any]]:
    """Each mode against the baseline, per workload and level: ratios of tokens/s p50 and throughput."""
    base_mode = baseline_mode(modes)
    index = {(r["workload"], r["mode"], r[level_key]): r for r in records}
    rows = []
    for (workload, mode, level), record in index.items():
        base = index.get((workload, base_mode, level))
        if mode == base_mode or base is None:
            continue
        rows.append(
            {
                "workload": workload,
                "mode": mode,
                "baseline": base_mode,
                level_key: level,
                "speedup_tokens_per_second_p50": _ratio(record, base, "tokens_per_second_p50"),
                "speedup_throughput": _ratio(record, base, "throughput_tokens_per_second"),
            }
        )
    return rows


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    return round(a[key] / b[key], 4) if a.get(key) and b.get(key) else None


def _fmt(value: Any, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def render_markdown(report: dict[str, Any]) -> str:
    key = report["level"]
    speedups = {(c["workload"], c["mode"], c[key]): c for c in report["comparisons"]}
    server = report.get("server", {})
    out = [
        "## HTTP benchmark",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
        f"Server: {server.get('url')} (model `{server.get('model')}`; "
        f"{'specserve' if server.get('reports_speculative') else 'peer server'}); "
        f"date {report.get('date')}; {report.get('requests_per_cell')} requests per cell, "
        f"max_tokens {report.get('max_tokens')}, temperature {report.get('temperature')}.",
        "",
        "tok/s = per-request decode-phase tokens/s (median); speed-up = tok/s p50 against "
        f"`{baseline_mode(report['modes'])}` in the same run; TTFT, TPOT, ITL in ms (p50 / p99); "
        "throughput = output tokens/s of all requests; acc = accepted / drafted tokens; "
        "MAL = mean acceptance length (1 + accepted / drafts).",
        "",
        f"| workload | mode | {key} | req (err) | tok/s p50 | speed-up | TTFT | TPOT | ITL | throughput "
        "| acc | MAL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["records"] + report["overall"]:
        cmp = speedups.get((r["workload"], r["mode"], r[key]))
        speedup = _fmt(cmp["speedup_tokens_per_second_p50"], 2, "x") if cmp else ""
        acc = r["acceptance_rate"]
        out.append(
            f"| {r['workload']} | {r['mode']} | {r[key]} | {r['requests']} ({r['errors']}) "
            f"| {_fmt(r['tokens_per_second_p50'])} | {speedup} "
            f"| {_fmt(r['ttft_p50'], 0)} / {_fmt(r['ttft_p99'], 0)} "
            f"| {_fmt(r['tpot_p50'], 1)} / {_fmt(r['tpot_p99'], 1)} "
            f"| {_fmt(r['itl_p50'], 1)} / {_fmt(r['itl_p99'], 1)} "
            f"| {_fmt(r['throughput_tokens_per_second'])} "
            f"| {_fmt(None if acc is None else acc * 100, 0, '%')} | {_fmt(r['mean_acceptance_length'], 2)} |"
        )
    errors = sorted({m for r in report["records"] for m in r["error_messages"]})
    if errors:
        out += ["", "Errors seen:", "", *[f"- {m}" for m in errors]]
    out += ["", *[f"- {n}" for n in report.get("notes", [])]] if report.get("notes") else []
    out += [
        "",
        "![speed-up by workload](speedup_by_workload.png)",
        "![latency by concurrency](latency_by_concurrency.png)",
        "![acceptance by position](acceptance_by_position.png)",
    ]
    return "\n".join(out) + "\n"
