"""The tools' subcommands: without the tools extra they say so in one line; the parser loads no tool."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

from cli_runner import run_cli
from specserve.tools import commands
from support.tiny_models import TinyModels
from tools.helpers import model_args, one_error_line


@pytest.mark.parametrize("command", [["bench", "--url", "http://127.0.0.1:9"], ["verify", "--in-process"]])
def test_a_tool_without_its_extra_names_the_extra(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def without_scipy(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "scipy" else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_scipy)
    code, _, err = run_cli(capfd, *command)
    assert code == 2
    line = one_error_line(err)
    assert "needs the tools extra (missing: scipy)" in line and "specserve[tools]" in line


def test_the_extra_lists_what_the_tools_import() -> None:
    """pyproject's ``tools`` extra and the check agree (a tool dependency added to one only fails here)."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["tools"]
    names = {spec.split(">")[0].split("=")[0].split("[")[0] for spec in extra}
    assert names == set(commands.TOOL_DEPENDENCIES)


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["evaluate", "--max-tokens", "0"], "max_tokens must be >= 1"),
        (["evaluate", "--temperature", "-1"], "temperature must be"),
        (["bench", "--in-process", "--max-tokens", "0"], "max_tokens must be >= 1"),
        (["verify", "--in-process", "--top-k", "-1"], "top_k must be >= 0"),
    ],
)
def test_a_bad_sampling_flag_is_one_line_before_any_model_loads(
    command: list[str], says: str, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capfd, *command, "--target", "/nonexistent/model.gguf")
    assert code == 2
    assert says in one_error_line(err)  # the bad target was never opened: the flag was checked first


def test_verify_refuses_to_pass_without_the_draft_arm_it_was_asked_for(
    tiny_models: TinyModels, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    args = model_args(tiny_models, draft=tmp_path / "missing.gguf")
    code, _, err = run_cli(capfd, "verify", "--in-process", *args, "--output-dir", str(tmp_path / "out"))
    assert code == 2
    assert "the draft model's arm cannot run" in one_error_line(err)
    assert not (tmp_path / "out" / "report.json").exists()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--block-size", "1"], "--block-size must be >= 2"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--top-k", "0"], "--top-k must be >= 1"),
    ],
)
def test_train_drafter_refuses_bad_flags_in_one_line(
    flags: list[str], says: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(
        capfd, "train-drafter", "--prompts", "p.jsonl", "--output-dir", str(tmp_path), *flags,
        "--target", "/nonexistent/model.gguf",
    )  # fmt: skip
    assert code == 2
    assert says in one_error_line(err)


def test_train_drafter_names_a_missing_prompt_file(
    tiny_models: TinyModels, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    code, _, err = run_cli(
        capfd, "train-drafter", "--prompts", str(tmp_path / "missing.jsonl"), "--output-dir",
        str(tmp_path / "out"), "--target", str(tiny_models.target), "--threads", "1",
    )  # fmt: skip
    assert code == 2
    assert "missing.jsonl" in one_error_line(err)


def test_bench_modes_include_dflash2_block_sizes(capfd: pytest.CaptureFixture[str]) -> None:
    from specserve.tools.measure.engine_bench import mode

    found = mode("dflash2@8")
    assert found is not None and found.block_size == 8 and found.drafters == ("dflash2",)
    assert mode("dflash2@1") is None and mode("dflash2@x") is None and mode("dflash2") is not None
    code, _, err = run_cli(capfd, "bench", "--in-process", "--modes", "plain,dflash3", "--target", "/none")
    assert code == 2 and "dflash2@B" in one_error_line(err)
