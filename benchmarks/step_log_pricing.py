"""How well the cost table priced a served run's steps: a step log replayed through the table as the engine
refines it, each step priced before its own measurement is folded in, by the rows the step verified.

    .venv/bin/python -m benchmarks.step_log_pricing --costs docs/bench/<dir>/costs-target-exact.json \
        STEPS.jsonl [STEPS.jsonl ...]

``STEPS.jsonl`` (or ``.jsonl.gz``) is what ``specserve serve --step-log`` wrote (engine/step_log.py),
``--costs`` the server's cached table (its calibration file). A server scales that table to the one-token
cost its load-time probe measured; the replay takes the same level from the log (the first step without a
prompt chunk: its logged price over the table's). Each step is priced by the table's cost of each of its
passes, then observed exactly where the engine observes (one pass, no prompt chunk: ``Engine._account``), so
a log written since the step log priced steps before their own observation has its ``priced`` field
reproduced, and a change to ``StepCostTable.observe`` can be judged on a run already recorded: the same
steps, the same measured seconds. Steps with prompt chunks are left out (their price includes the prompt).

``--own-size`` refines the table as before verify sizes shared their observations, for comparison.

Prints one JSON object: per band of verified rows (1, 2–4, 5–8, 9–16, 17–32, 33+), one-pass steps apart
from steps of several passes (``"17-32 in 2 passes"``), the steps, their measured seconds and measured /
priced.
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
    low, high = BANDS[_band_index(rows)]
    return str(low) if low == high else f"{low}+" if high == 10**9 else f"{low}-{high}"


def _band_index(rows: int) -> int:
    return next(i for i, (low, high) in enumerate(BANDS) if low <= rows <= high)


class OwnSizeTable(StepCostTable):
    """The table as it refined itself before verify sizes shared their observations (``--own-size``): a
    verify size moved its own entry only; a one-token step still moves the whole curve."""

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens == 1 or not 0 < n_tokens < self.seconds.size:
            super().observe(n_tokens, seconds)
            return
        current = self.seconds[n_tokens]
        if current > 0 and not (current / 3 < seconds < current * 3):
            return
        self.seconds[n_tokens] = (1 - self.ema) * current + self.ema * seconds
        self.observations += 1


def price_steps(table: StepCostTable, steps: Iterable[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per band of decoding rows and passes: steps, measured seconds, measured / priced (the table brought
    to the log's level, then observing as the engine does)."""
    sums: dict[tuple[int, int], list[float]] = {}
    leveled = False
    for step in steps:
        if step.get("prefill"):
            continue
        passes: list[int] = step["passes"]
        priced = sum(table(n) for n in passes)
        if not leveled and priced > 0 and step.get("priced", 0) > 0:
            table.seconds *= step["priced"] / priced  # the level the server's probe set at load
            priced, leveled = step["priced"], True
        total = sums.setdefault((_band_index(sum(passes)), len(passes)), [0, 0.0, 0.0])
        total[0] += 1
        total[1] += step["seconds"]
        total[2] += priced
        if len(passes) == 1:
            table.observe(passes[0], step["seconds"])
    return {
        band(BANDS[index][0]) + ("" if count == 1 else f" in {count} passes"): {
            "steps": s[0],
            "seconds": round(s[1], 3),
            "measured_over_priced": round(s[1] / s[2], 4),
        }
        for (index, count), s in sorted(sums.items())
        if s[2] > 0
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", type=Path, required=True, help="the server's calibration file")
    parser.add_argument("logs", type=Path, nargs="+", help="step logs (specserve serve --step-log)")
    parser.add_argument("--own-size", action="store_true", help="each verify size learns on its own (before)")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"machine": cpu_model(), "costs": str(args.costs), "own_size": args.own_size}
    result["logs"] = {}
    for path in args.logs:
        text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
        lines = text.splitlines()
        steps = (json.loads(line) for line in lines if line)
        table = load_costs(args.costs)
        if args.own_size:
            table = OwnSizeTable(table.seconds)
        result["logs"][str(path)] = price_steps(table, steps)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
