"""Helpers of the tool tests: model flags for the tiny pair, the one-line error a tool prints."""

from __future__ import annotations

from pathlib import Path

from support.tiny_models import TinyModels


def model_args(models: TinyModels, *, draft: Path | None = None) -> list[str]:
    return [
        "--target", str(models.target), "--draft", str(draft or models.draft_close),
        "--threads", "1", "--draft-p-min", "0", "--ctx-size", "1024",
    ]  # fmt: skip


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("specserve: error: ")
    return lines[0]
