"""``python -m benchmarks.exact_cost`` (formerly ``bench --in-process --exact-cost``) on the tiny models."""

from __future__ import annotations

from pathlib import Path

from bench_env import isolated_env  # noqa: F401  (autouse)

from benchmarks.exact_cost import measure_exact_cost, render_exact_cost, time_calls
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
    text = render_exact_cost(data, "python -m benchmarks.exact_cost")
    assert "| 8 |" in text and "2 rounds" in text


def test_a_stock_build_is_a_third_arm_in_its_own_processes(tiny_models: TinyModels) -> None:
    """The stock arm loads the libraries of another build (here: this very build's, found by the path
    llama-cpp-python loads by default), in its own process."""
    import llama_cpp

    lib = str(Path(llama_cpp.__file__).parent / "lib")
    data = measure_exact_cost(str(tiny_models.target), 1, rounds=3, sizes=(1, 4), repeats=1, stock_lib=lib)
    assert data["stock_lib"] == lib
    assert all(row["stock_ms"] > 0 for row in data["calls"].values())
    text = render_exact_cost(data, "python -m benchmarks.exact_cost --stock-lib DIR")
    assert "exact / stock" in text and "| 4 |" in text
