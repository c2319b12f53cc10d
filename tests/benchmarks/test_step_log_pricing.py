"""``python -m benchmarks.step_log_pricing``: a step log replayed through the cost table, refined as the
engine refines it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import step_log_pricing
from specserve.engine.cost_model import StepCostTable

TEN_MS_A_ROW = [0.0] + [0.01 * n for n in range(1, 65)]


def step(passes: list[int], seconds: float, prefill: list[list[int]] | None = None) -> dict[str, Any]:
    return {"passes": passes, "seconds": seconds, "priced": 0.0, "prefill": prefill or []}


def test_each_step_is_priced_before_the_table_observes_it_and_by_its_band(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    costs, log = tmp_path / "costs.json", tmp_path / "steps.jsonl"
    costs.write_text(json.dumps({"seconds": TEN_MS_A_ROW}))
    steps = [step([1], 0.01)] * 50 + [step([24], 0.312)] * 60  # 24 rows cost 1.3x the table
    steps += [step([4, 16], 0.26), step([1], 0.5, prefill=[[0, 50]])]  # two passes; a prompt (left out)
    log.write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert step_log_pricing.main(["--costs", str(costs), str(log)]) == 0
    bands = json.loads(capsys.readouterr().out)["logs"][str(log)]
    assert list(bands) == ["1", "17-32"]  # 4 + 16 rows verified in one step: 20
    assert bands["1"] == {"steps": 50, "seconds": 0.5, "measured_over_priced": 1.0}
    assert bands["17-32"]["steps"] == 61
    assert bands["17-32"]["seconds"] == pytest.approx(60 * 0.312 + 0.26)
    assert 1.0 < bands["17-32"]["measured_over_priced"] < 1.3  # the first 24-row steps were priced at 1.0x


def test_a_size_never_seen_is_priced_from_its_neighbours_observations() -> None:
    """The reason for the tool: 20-row steps after many 24-row ones that cost 1.3x the table."""
    table = StepCostTable(np.array(TEN_MS_A_ROW))
    step_log_pricing.price_steps(table, [step([24], 0.312)] * 100)
    twenty = step_log_pricing.price_steps(table, [step([20], 0.26)] * 5)
    assert twenty["17-32"]["measured_over_priced"] < 1.1  # 1.3 where each size learnt only from itself


def test_rows_fall_in_their_bands() -> None:
    rows = (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 200)
    names = ["1", "2-4", "2-4", "5-8", "5-8", "9-16", "9-16", "17-32", "17-32", "33+", "33+"]
    assert [step_log_pricing.band(n) for n in rows] == names
