"""``python -m benchmarks.depth_cost`` on the tiny target: every depth and size timed, beside the table."""

from __future__ import annotations

import json

import pytest
from bench_env import isolated_env  # noqa: F401  (autouse)

from benchmarks import depth_cost
from support.tiny_models import TinyModels


def test_each_depth_times_each_size_beside_the_table(
    tiny_models: TinyModels, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--target", str(tiny_models.target), "--draft", "none", "--threads", "1"]
    argv += ["--depths", "16", "300", "--rows", "1", "4", "--repeats", "2"]
    assert depth_cost.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["exactness"] == "batch-invariant" and set(data["table_ms"]) == {"1", "4"}
    for depth in ("16", "300"):
        assert set(data[depth]["ms"]) == {"1", "4"} and data[depth]["steps"]["1"] == 1.0
        assert all(ms > 0 for ms in data[depth]["ms"].values())


def test_a_depth_beyond_the_context_is_a_usage_error(tiny_models: TinyModels) -> None:
    argv = ["--target", str(tiny_models.target), "--draft", "none", "--threads", "1", "--ctx-size", "256"]
    with pytest.raises(SystemExit) as exit_info:
        depth_cost.main([*argv, "--depths", "1024"])
    assert exit_info.value.code == 2


def test_flash_attention_on_and_off_take_turns_at_each_depth(
    tiny_models: TinyModels, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--target", str(tiny_models.target), "--draft", "none", "--threads", "1", "--flash-attention-ab"]
    assert depth_cost.main([*argv, "--depths", "16", "300", "--rows", "1", "2", "--repeats", "1"]) == 0
    arms = json.loads(capsys.readouterr().out)["flash_attention"]
    assert set(arms) == {"on", "off"}
    for arm in arms.values():
        assert set(arm) == {"16", "300", "table_ms"} and arm["300"]["prefill_tokens_per_s"] > 0
