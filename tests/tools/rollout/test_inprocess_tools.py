"""``specserve verify --in-process`` and ``specserve evaluate`` on the tiny models (exact mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import run_cli
from support.tiny_models import TinyModels
from tools.helpers import model_args, one_error_line


def test_verify_in_process_passes(
    tiny_models: TinyModels, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, stdout, err = run_cli(
        capfd, "verify", "--in-process", *model_args(tiny_models), "--output-dir", str(tmp_path),
        "--workload", "qa", "code-edit", "--limit", "1", "--max-tokens", "24",
        "--seeds", "12", "--sample-tokens", "2", "--top-k", "3",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is True and report["unit"] == "token ids"
    assert report["arms"] == ["ngram", "suffix", "draft-model"]
    assert report["greedy"]["equal"] == report["greedy"]["total"] == 6  # 2 prompts x 3 drafters
    assert all(c["divergence"] is None for c in report["greedy"]["cases"])
    sampled = report["sampled"]
    assert sampled["tests"] == 2 * 3 * 2  # prompts x drafters x positions
    for case in sampled["cases"]:
        assert case["samples"] == 12
        assert case["plain_loglik"] < 0 and case["spec_loglik"] < 0
    assert "**PASS**" in stdout and (tmp_path / "report.md").read_text() == stdout


def test_verify_fails_against_a_different_target(
    tiny_models: TinyModels, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The plain arm runs on the unrelated tiny draft: outputs and distributions must differ."""
    code, stdout, err = run_cli(
        capfd, "verify", "--in-process", *model_args(tiny_models), "--output-dir", str(tmp_path),
        "--workload", "qa", "--limit", "1", "--max-tokens", "12", "--drafter", "ngram",
        "--seeds", "16", "--sample-tokens", "1", "--top-k", "2",
        "--reference-target", str(tiny_models.draft),
    )  # fmt: skip
    assert code == 1, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is False
    (case,) = report["greedy"]["cases"]
    assert case["arm"] == "ngram" and not case["equal"]
    divergence = case["divergence"]
    assert divergence["position"] >= 0
    assert divergence["plain_token"] != divergence["spec_token"]
    assert divergence["logit_margin"] >= 0.0
    # The target's logits there: its own choice is the speculative arm's token (the target ran that arm).
    assert divergence["spec_logit"] >= divergence["plain_logit"]
    assert "**FAIL**" in stdout and "verify: FAIL" in err


def test_verify_needs_one_source(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capfd, "verify", "--output-dir", str(tmp_path))
    assert code == 2
    assert "--url BASE_URL or --in-process" in one_error_line(err)


def test_evaluate_recommends_a_configuration(
    tiny_models: TinyModels, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, stdout, err = run_cli(
        capfd, "evaluate", *model_args(tiny_models), "--output-dir", str(tmp_path),
        "--workload", "qa", "code-edit", "--limit", "1", "--max-tokens", "24", "--draft-lengths", "1,4,8",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["workloads"]) == {"qa", "code-edit"}
    labels = {"plain", "auto", *(f"{d} k={k}" for d in ("ngram", "suffix", "draft-model") for k in (1, 4, 8))}
    assert not any("run as" in n for n in report["notes"])  # batch-invariant exact mode caps no draft length
    for section in [*report["workloads"].values(), report["overall"]]:
        assert set(section["configs"]) == labels
        plain = section["configs"]["plain"]
        assert plain["num_drafts"] == 0 and plain["expected_speedup"] == 1.0
        model = section["configs"]["draft-model k=4"]
        assert model["num_drafts"] > 0 and 0.0 <= model["acceptance_rate"] <= 1.0
        assert len(model["acceptance_by_position"]) == 4
        assert model["expected_speedup"] > 0
        rec = section["recommendation"]
        assert rec["config"] in labels and rec["flags"].startswith("--drafter ")
        assert rec["expected_speedup"] >= 1.0
    assert "### Summary" in stdout and (tmp_path / "report.md").read_text() == stdout
