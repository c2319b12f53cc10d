"""The harnesses' entry points (``python -m benchmarks.<name>``), and what the old bench flags do now.

What moved out of the wheel must not stop working: each entry point takes the flags its ``specserve bench``
spelling took (the engine settings' flags included), reports a user error as one line, writes its reports,
and starts its fresh processes from any working directory; the old flags fail naming the new command.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from bench_env import isolated_env  # noqa: F401  (autouse)

import benchmarks
from benchmarks import exact_cost, fresh_generate, grammar_cost, llama_bench
from benchmarks.harness import run
from cli_runner import run_cli
from specserve.tools.commands import MOVED_BENCH_FLAGS
from support.tiny_models import TinyModels

ENTRY_POINTS: dict[str, tuple[Callable[[list[str]], int], tuple[str, ...]]] = {
    "benchmarks.exact_cost": (exact_cost.main, ("--stock-lib",)),
    "benchmarks.llama_bench": (llama_bench.main, ("--vs-llama-bench",)),
    "benchmarks.fresh_generate": (fresh_generate.main, ("--paired", "--max-tokens", "--prompts", "--kinds")),
    "benchmarks.grammar_cost": (grammar_cost.main, ()),
}


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_each_entry_point_takes_the_engine_flags(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    main, own = ENTRY_POINTS[module]
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert f"python -m {module}" in usage
    for flag in (
        "--output-dir",
        "--repeats",
        "--config",
        "--target",
        "--draft",
        "--threads",
        "--exact",
        *own,
    ):
        assert flag in usage, (module, flag)
    assert module in (benchmarks.__doc__ or ""), "benchmarks/__init__.py lists every entry point"


def test_a_user_error_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = run("benchmarks.grammar_cost", grammar_cost.main, ["--target", str(tmp_path / "none.gguf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("python -m benchmarks.grammar_cost: error: ") and "none.gguf" in err


@pytest.mark.parametrize("flag", sorted(MOVED_BENCH_FLAGS))
def test_a_moved_bench_flag_names_its_command(flag: str, capfd: pytest.CaptureFixture[str]) -> None:
    command, value = MOVED_BENCH_FLAGS[flag]
    code, out, err = run_cli(capfd, "bench", "--in-process", flag, *([value] if value else []))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and not out, err
    assert lines[0].startswith(f"specserve: error: {flag} moved") and f"python -m {command}" in lines[0]
    assert command.split()[0] in ENTRY_POINTS


def test_moved_flags_are_not_in_bench_help(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capfd, "bench", "--help")
    assert code == 0 and "--in-process" in out
    assert not [flag for flag in MOVED_BENCH_FLAGS if flag in out]


def test_exact_cost_writes_its_report_from_any_directory(
    tiny_models: TinyModels,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Run elsewhere than the repository root: its arms' processes still find ``benchmarks``."""
    monkeypatch.chdir(tmp_path)
    argv = ["--target", str(tiny_models.target), "--draft", "none", "--threads", "1", "--output-dir", "out"]
    assert exact_cost.main(argv) == 0
    data = json.loads((tmp_path / "out" / "exact_cost.json").read_text())
    assert data["rounds"] == 3 and data["exactness"] == "batch-invariant"
    markdown = (tmp_path / "out" / "exact_cost.md").read_text()
    assert "Command: `python -m benchmarks.exact_cost --target" in markdown and "| 32 |" in markdown
    assert "## Exact mode cost" in capsys.readouterr().out


def test_fresh_generate_filters_its_prompts_and_pairs(tiny_models: TinyModels, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"kind": "list", "prompt": "one two three one two three"}, {"kind": "other", "prompt": "hello"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    argv = [
        "--paired", "--prompts", str(prompts), "--kinds", "list", "--max-tokens", "8",
        "--target", str(tiny_models.target), "--draft", "none", "--threads", "1", "--output-dir", str(out),
    ]  # fmt: skip
    assert fresh_generate.main(argv) == 0
    data = json.loads((out / "fresh_process.json").read_text())
    assert data["paired"] and data["rounds"] == 2 and [row["kind"] for row in data["prompts"]] == ["list"]
    assert "python -m benchmarks.fresh_generate --paired" in (out / "fresh_process.md").read_text()
