"""A Hugging Face checkpoint directory as the target, as a GPU user downloads it: ``--target DIR`` picks
the torch runtime by itself (``--backend auto``) and answers as the same weights written as GGUF do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from cli_runner import run_cli
from support.hf_to_gguf import hf_to_gguf
from support.tiny_hf import write_tiny_hf_checkpoint


def generate(capfd: pytest.CaptureFixture[str], *flags: str) -> dict[str, object]:
    code, out, err = run_cli(
        capfd, "generate", "--prompt", "def add(a, b):", "--max-tokens", "24", "--json",
        "--draft", "none", "--threads", "1", "--ctx-size", "256", "--no-calibration-cache", *flags,
    )  # fmt: skip
    assert code == 0, err
    result: dict[str, object] = json.loads(out)
    return result


def test_checkpoint_dir_target_equals_its_gguf(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    checkpoint = write_tiny_hf_checkpoint(tmp_path / "qwen2", "qwen2")
    gguf_path = hf_to_gguf(checkpoint, tmp_path / "qwen2.gguf")
    same = ("--device", "cpu", "--dtype", "float32")
    from_dir = generate(capfd, "--target", str(checkpoint), *same)  # --backend auto: torch for a directory
    from_gguf = generate(capfd, "--target", str(gguf_path), "--backend", "torch", *same)
    assert from_dir["token_ids"] == from_gguf["token_ids"]
    assert len(from_dir["token_ids"]) == 24  # type: ignore[arg-type]


def test_llama_cpp_refuses_a_checkpoint_dir_in_one_line(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    checkpoint = write_tiny_hf_checkpoint(tmp_path / "qwen2", "qwen2")
    code, _, err = run_cli(
        capfd,
        "generate",
        "--prompt",
        "x",
        "--target",
        str(checkpoint),
        "--draft",
        "none",
        "--backend",
        "llama.cpp",
    )
    assert code == 2
    assert "checkpoint directory" in err and "Traceback" not in err
