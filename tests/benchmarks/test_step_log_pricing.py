"""``python -m benchmarks.step_log_pricing``: a step log replayed through the cost table, refined as the
engine refines it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import step_log_pricing
from specserve.engine.cost_model import StepCostTable

TEN_MS_A_ROW = [0.0] + [0.01 * n for n in range(1, 65)]


def step(passes: list[int], seconds: float, prefill: list[list[int]] | None = None) -> dict[str, Any]:
    return {"passes": passes, "seconds": seconds, "prefill": prefill or []}


def table() -> StepCostTable:
    return StepCostTable(np.array(TEN_MS_A_ROW))


def test_a_step_is_priced_before_the_table_observes_it() -> None:
    bands = step_log_pricing.price_steps(table(), [step([24], 0.312)])  # 1.3x the table's 0.24 s
    assert bands == {"17-32": {"steps": 1, "seconds": 0.312, "measured_over_priced": 1.3}}


def test_only_one_pass_steps_without_a_prompt_are_observed_as_the_engine_does() -> None:
    costs = table()
    steps = [step([4, 16], 0.3), step([12], 0.15, prefill=[[0, 8]])]  # 1.5x and 1.25x: not outliers
    bands = step_log_pricing.price_steps(costs, steps)
    assert np.array_equal(costs.seconds, np.array(TEN_MS_A_ROW))
    assert bands == {"17-32 in 2 passes": {"steps": 1, "seconds": 0.3, "measured_over_priced": 1.5}}
    step_log_pricing.price_steps(costs, [step([12], 0.15)])
    assert costs(12) > 0.12


def test_the_table_starts_at_the_level_the_server_started_at() -> None:
    """A server scales its cached table to its load-time probe; the log's first price says by how much."""
    costs = table()
    first = {**step([1], 0.02), "priced": 0.02}  # the server's table started at twice the file's
    bands = step_log_pricing.price_steps(costs, [first, step([8], 0.16)])
    assert bands["1"]["measured_over_priced"] == 1.0
    assert bands["5-8"]["measured_over_priced"] == pytest.approx(1.0)


def test_a_size_never_seen_is_priced_from_its_neighbours_observations() -> None:
    """The reason for the change the tool was written for: 20-row steps after many 24-row ones that cost
    1.3x the table."""
    costs = table()
    step_log_pricing.price_steps(costs, [step([24], 0.312)] * 100)
    twenty = step_log_pricing.price_steps(costs, [step([20], 0.26)] * 5)
    assert twenty["17-32"]["measured_over_priced"] < 1.1  # 1.3 where each size learnt only from itself


def test_the_command_reads_plain_and_gzipped_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs, plain, packed = tmp_path / "costs.json", tmp_path / "a.jsonl", tmp_path / "b.jsonl.gz"
    costs.write_text(json.dumps({"seconds": TEN_MS_A_ROW}))
    lines = "".join(json.dumps(s) + "\n" for s in [step([1], 0.01)] * 3 + [step([1], 0.5, [[0, 50]])])
    plain.write_text(lines)
    packed.write_bytes(gzip.compress(lines.encode()))
    assert step_log_pricing.main(["--costs", str(costs), str(plain), str(packed)]) == 0
    logs = json.loads(capsys.readouterr().out)["logs"]
    expected = {"1": {"steps": 3, "seconds": 0.03, "measured_over_priced": 1.0}}
    assert logs == {str(plain): expected, str(packed): expected}


def test_rows_fall_in_their_bands() -> None:
    rows = (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 200)
    names = ["1", "2-4", "2-4", "5-8", "5-8", "9-16", "9-16", "17-32", "17-32", "33+", "33+"]
    assert [step_log_pricing.band(n) for n in rows] == names


def test_own_size_keeps_the_old_refinement_for_comparison() -> None:
    costs = step_log_pricing.OwnSizeTable(np.array(TEN_MS_A_ROW))
    step_log_pricing.price_steps(costs, [step([24], 0.312)] * 100)
    assert costs(24) == pytest.approx(0.312, rel=0.01)
    assert costs(20) == pytest.approx(0.2) and costs(28) == pytest.approx(0.28)
    step_log_pricing.price_steps(costs, [step([1], 0.02)] * 300)  # a one-token step still moves them all
    assert costs(20) == pytest.approx(0.4, rel=0.01)
