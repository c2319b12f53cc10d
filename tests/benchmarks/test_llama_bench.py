"""The llama-bench comparison's specserve side on the tiny models (llama-bench itself is not built in CI)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_env import isolated_env  # noqa: F401  (autouse)

from benchmarks.llama_bench import (
    SIDES,
    engine_tg,
    render_llama_peer,
    run_llama_bench,
    runtime_tests,
)
from specserve.backends.llama_cpp import LlamaCppRuntime
from support.tiny_models import TinyModels


def test_runtime_and_engine_sides_measure_what_llama_bench_does(tiny_models: TinyModels) -> None:
    runtime = LlamaCppRuntime(tiny_models.target, n_threads=1, context_per_sequence=512)
    try:
        result = runtime_tests(runtime, n_prompt=64, n_gen=16, seed=0)
        assert set(result) == {"pp", "tg"} and min(result.values()) > 0
        assert engine_tg(runtime, 16) > 0
        # Both leave the sequence empty: a fresh 8-token decode from position 0 is accepted.
        runtime.free(0)
        assert runtime_tests(runtime, n_prompt=8, n_gen=2, seed=1)["tg"] > 0
    finally:
        runtime.close()


def test_a_failing_llama_bench_is_reported(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="llama-bench failed"):
        run_llama_bench(Path("/bin/false"), str(tmp_path / "m.gguf"), 1, 8, 4)


def test_report_lists_every_side_with_ratios() -> None:
    rounds = [
        {
            "llama-bench": {"pp": 100.0, "tg": 30.0},
            "runtime exact": {"pp": 99.0, "tg": 29.7},
            "runtime fast": {"pp": 101.0, "tg": 30.3},
            "engine plain": {"tg": 29.1},
        }
    ]
    data = {
        "settings": {"threads": 2, "n_prompt": 256, "n_gen": 128},
        "exactness": "batch-invariant",
        "rounds": rounds,
        "median_ratio_to_llama_bench": {
            "runtime exact": {"pp": 0.99, "tg": 0.99},
            "runtime fast": {"pp": 1.01, "tg": 1.01},
            "engine plain": {"tg": 0.97},
        },
    }
    text = render_llama_peer(data, "python -m benchmarks.llama_bench --vs-llama-bench x")
    for side in SIDES:
        assert f"| {side} |" in text
    assert "| engine plain | – | 29.1 | – | 0.970 |" in text and "`batch-invariant`" in text


def test_a_side_runs_in_its_own_process(tiny_models: TinyModels) -> None:
    from benchmarks.llama_bench import _side_in_subprocess

    side = _side_in_subprocess(str(tiny_models.target), True, 1, 32, 8, 0)
    assert side["exactness"] == "batch-invariant"
    assert side["runtime"]["pp"] > 0 and side["runtime"]["tg"] > 0 and side["engine"]["tg"] > 0
