"""``specserve bench --in-process --exact-cost`` pieces on the tiny models."""

from __future__ import annotations

from specserve.tools.measure.engine_report import render_exact_cost
from specserve.tools.measure.exact_cost import measure_exact_cost, time_calls
from support.tiny_models import TinyModels


def test_time_calls_measures_every_size(tiny_models: TinyModels) -> None:
    out = time_calls(str(tiny_models.target), True, 1, (1, 4, 16), repeats=2)
    assert out["exactness"] == "batch-invariant"
    assert set(out["ms"]) == {1, 4, 16} and min(out["ms"].values()) > 0


def test_each_mode_runs_in_its_own_processes(tiny_models: TinyModels) -> None:
    data = measure_exact_cost(str(tiny_models.target), 1, rounds=2, sizes=(1, 8), repeats=1)
    assert data["exactness"] == "batch-invariant" and data["rounds"] == 2
    assert set(data["calls"]) == {"1", "8"}
    assert all(row["exact_ms"] > 0 and row["fast_ms"] > 0 for row in data["calls"].values())
    text = render_exact_cost(data, "specserve bench --in-process --exact-cost")
    assert "| 8 |" in text and "2 rounds" in text
