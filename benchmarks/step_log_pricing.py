"""How well the cost table priced a served run's steps: a step log replayed through the table as the engine
refines it, each step priced before its own measurement is folded in, by the rows the step verified.

    .venv/bin/python -m benchmarks.step_log_pricing --costs docs/bench/<dir>/costs-target-exact.json \
        STEPS.jsonl [STEPS.jsonl ...]

``STEPS.jsonl`` (or ``.jsonl.gz``) is what ``specserve serve --step-log`` wrote (engine/step_log.py),
``--costs`` the table the server started from (its calibration file). Each step's price is the table's cost
of each of its passes; the table then observes it exactly where the engine does (one pass, no prompt
chunk: ``Engine._account``). The engine's own ``priced`` field is the same number; replaying lets a change
to ``StepCostTable.observe`` be judged on a run already recorded: the same steps, the same measured seconds.
Steps with prompt chunks are left out of the bands (their price includes the prompt).

Prints one JSON object: per band of verified rows (1, 2–4, 5–8, 9–16, 17–32, 33+), the steps, their measured
seconds and measured / priced.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.agent_replay import load_costs
from benchmarks.batch_pass import cpu_model
from specserve.engine.cost_model import StepCostTable

BANDS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 10**9))


def band(rows: int) -> str:
    low, high = next(b for b in BANDS if b[0] <= rows <= b[1])
    return str(low) if low == high else f"{low}+" if high == 10**9 else f"{low}-{high}"


def price_steps(table: StepCostTable, steps: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per band of decoding rows: steps, measured seconds, measured / priced (the table observing as it
    goes)."""
    sums: dict[str, list[float]] = {}
    for step in steps:
        passes: list[int] = step["passes"]
        priced = sum(table(n) for n in passes)
        if step.get("prefill"):
            continue
        total = sums.setdefault(band(sum(passes)), [0, 0.0, 0.0])
        total[0] += 1
        total[1] += step["seconds"]
        total[2] += priced
        if len(passes) == 1:
            table.observe(passes[0], step["seconds"])
    order = [band(low) for low, _ in BANDS]
    return {
        name: {"steps": s[0], "seconds": round(s[1], 3), "measured_over_priced": round(s[1] / s[2], 4)}
        for name, s in sorted(sums.items(), key=lambda kv: order.index(kv[0]))
        if s[2] > 0
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", type=Path, required=True, help="the server's calibration file")
    parser.add_argument("logs", type=Path, nargs="+", help="step logs (specserve serve --step-log)")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"machine": cpu_model(), "costs": str(args.costs), "logs": {}}
    for path in args.logs:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        lines = text.splitlines()
        steps = (json.loads(line) for line in lines if line)
        result["logs"][str(path)] = price_steps(load_costs(args.costs), steps)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
