"""The operator tools on the torch runtime, unchanged: ``bench --in-process``, ``verify --in-process``
and ``evaluate`` with ``--backend torch`` on the tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import run_cli
from support.tiny_models import TinyModels
from tools.helpers import model_args

pytest.importorskip("torch")

TORCH = ["--backend", "torch", "--device", "cpu", "--no-calibration-cache"]


def test_verify_in_process_passes_on_torch(
    tiny_models: TinyModels, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(
        capfd, "verify", "--in-process", *model_args(tiny_models), *TORCH, "--output-dir", str(tmp_path),
        "--workload", "qa", "--limit", "1", "--max-tokens", "16", "--seeds", "8", "--sample-tokens", "1",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is True
    # 1 prompt x 3 drafters (ngram, suffix, draft-model)
    assert report["greedy"]["equal"] == report["greedy"]["total"] == 3


def test_bench_in_process_and_evaluate_on_torch(
    tiny_models: TinyModels, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(
        capfd, "bench", "--in-process", *model_args(tiny_models), *TORCH, "--output-dir", str(tmp_path / "b"),
        "--workload", "code-edit", "--limit", "1", "--max-tokens", "16", "--repeats", "1",
    )  # fmt: skip
    assert code == 0, err
    bench = json.loads((tmp_path / "b" / "report.json").read_text())
    assert bench["settings"]["backend"] == "torch" and "torch" in bench["settings"]["runtime"]
    assert bench["settings"]["exactness"] == "batch-invariant"
    code, _, err = run_cli(
        capfd, "evaluate", *model_args(tiny_models), *TORCH, "--output-dir", str(tmp_path / "e"),
        "--workload", "qa", "--limit", "1", "--max-tokens", "16", "--draft-lengths", "2",
    )  # fmt: skip
    assert code == 0, err
    assert "qa" in json.loads((tmp_path / "e" / "report.json").read_text())["workloads"]
