"""The ``specserve`` command line on the tiny models: the JSON contract, greedy losslessness, user errors.

Most runs call ``specserve.cli.main`` in-process; one of each kind also runs as ``python -m specserve.cli``
to check what a user actually sees on stdout and stderr (llama.cpp writes to the C streams).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli_runner import run_cli as run_main
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.chat import render_chat
from specserve.config import Settings
from specserve.config_sources import redacted
from support.tiny_models import TinyModels

REPEATING_PROMPT = "the the the the the the"


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No SPECSERVE_* settings from the developer's shell; caches (calibration) go to a temporary dir."""
    for name in list(os.environ):
        if name.startswith("SPECSERVE_"):
            monkeypatch.delenv(name)
    model_dir = tmp_path / "model-cache"
    monkeypatch.setenv("SPECSERVE_MODEL_DIR", str(model_dir))
    monkeypatch.setenv("SPECSERVE_CALIBRATION_CACHE", "false")
    yield model_dir


@contextlib.contextmanager
def tiny_runtime(path: Path) -> Iterator[LlamaCppRuntime]:
    runtime = LlamaCppRuntime(path, n_threads=1, context_per_sequence=64)
    try:
        yield runtime
    finally:
        runtime.close()


def run_subprocess(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "specserve.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=dict(os.environ),
        check=False,
    )


def generate_args(target: Path, prompt: str = "def f(", max_tokens: int = 8, *extra: str) -> list[str]:
    return [
        "generate", "--target", str(target), "--draft", "none", "--threads", "1",
        "--prompt", prompt, "--max-tokens", str(max_tokens), "--json", *extra,
    ]  # fmt: skip


def check_contract(result: dict[str, Any], max_tokens: int) -> None:
    assert set(result) >= {"text", "token_ids", "finish_reason", "usage", "speculative", "timings"}
    assert isinstance(result["text"], str)
    assert isinstance(result["token_ids"], list)
    assert all(isinstance(t, int) for t in result["token_ids"])
    assert 1 <= len(result["token_ids"]) <= max_tokens
    assert result["finish_reason"] in ("length", "stop")

    usage = result["usage"]
    assert set(usage) >= {"prompt_tokens", "completion_tokens"}
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] == len(result["token_ids"])

    spec = result["speculative"]
    keys = {
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "mean_acceptance_length",
        "acceptance_rate",
    }
    assert set(spec) >= keys
    assert 0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert spec["num_drafts"] <= spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] >= 1.0
    assert 0.0 <= spec["acceptance_rate"] <= 1.0

    timings = result["timings"]
    assert set(timings) >= {"prompt_ms", "generate_ms", "tokens_per_second"}
    assert all(isinstance(v, int | float) and v >= 0 for v in timings.values())


def assert_one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith("specserve: error: ")
    return lines[0]


# -- generate -------------------------------------------------------------------------------------


def test_generate_json_in_process(tiny_models: TinyModels, capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capfd, *generate_args(tiny_models.target))
    assert code == 0, err
    result = json.loads(out)
    check_contract(result, 8)
    # The tiny models' end-of-generation logits are far below the rest: generation runs to max_tokens.
    assert result["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 8
    assert result["speculative"]["num_drafts"] == 0  # --draft none, and nothing repeats in 8 tokens

    with tiny_runtime(tiny_models.target) as runtime:
        assert result["usage"]["prompt_tokens"] == len(runtime.tokenize("def f("))
        assert result["text"] == runtime.detokenize(result["token_ids"])


def test_generate_json_as_subprocess(tiny_models: TinyModels, tmp_path: Path) -> None:
    proc = run_subprocess(*generate_args(tiny_models.target), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # stdout holds exactly one JSON object
    check_contract(result, 8)
    assert proc.stderr.strip() == ""


def test_generate_is_deterministic_in_and_out_of_process(
    tiny_models: TinyModels, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_main(capfd, *generate_args(tiny_models.target))
    assert code == 0
    proc = run_subprocess(*generate_args(tiny_models.target), cwd=tmp_path)
    assert json.loads(proc.stdout)["token_ids"] == json.loads(out)["token_ids"]


def test_generate_plain_text_output(tiny_models: TinyModels, capfd: pytest.CaptureFixture[str]) -> None:
    args = [a for a in generate_args(tiny_models.target) if a != "--json"]
    code, out, err = run_main(capfd, *args)
    assert code == 0
    assert out.endswith("\n")
    assert "8 tokens" in err and "finish=length" in err


def test_generate_chat(tiny_models: TinyModels, capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_main(capfd, *generate_args(tiny_models.target, "hi", 6, "--chat"))
    assert code == 0, err
    chat = json.loads(out)
    check_contract(chat, 6)
    with tiny_runtime(tiny_models.target) as runtime:
        rendered = render_chat(runtime, [{"role": "user", "content": "hi"}])
        assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        assert chat["usage"]["prompt_tokens"] == len(runtime.tokenize(rendered, parse_special=True))

    code, out, _ = run_main(
        capfd, *generate_args(tiny_models.target, "hi", 6, "--chat", "--system", "Be brief.")
    )
    assert code == 0
    with_system = json.loads(out)
    assert with_system["usage"]["prompt_tokens"] > chat["usage"]["prompt_tokens"]


def test_greedy_output_is_the_same_with_every_drafter(
    tiny_models: TinyModels, capfd: pytest.CaptureFixture[str]
) -> None:
    def run(*extra: str) -> dict[str, Any]:
        code, out, err = run_main(capfd, *generate_args(tiny_models.target, REPEATING_PROMPT, 96, *extra))
        assert code == 0, err
        result: dict[str, Any] = json.loads(out)
        check_contract(result, 96)
        return result

    plain = run("--drafter", "none")
    assert plain["speculative"]["num_drafts"] == 0
    ngram = run("--drafter", "ngram")
    ngram_fixed = run("--drafter", "ngram", "--draft-policy", "fixed")
    draft_model = run(
        "--drafter", "draft-model", "--draft", str(tiny_models.draft_close),
        "--draft-policy", "fixed", "--draft-p-min", "0",
    )  # fmt: skip

    for result in (ngram, ngram_fixed, draft_model):
        assert result["token_ids"] == plain["token_ids"]
        assert result["text"] == plain["text"]
    assert ngram_fixed["speculative"]["num_drafts"] > 0  # the output repeats a few bigrams
    spec = draft_model["speculative"]
    assert spec["num_drafts"] > 0
    assert spec["num_accepted_tokens"] > 0
    assert spec["mean_acceptance_length"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_drafts"], abs=1e-3
    )


# -- user errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--ctx-size", "0"], "context_size"),
        (["--num-draft-tokens", "100"], "num_draft_tokens"),
    ],
)
def test_bad_arguments_fail_with_one_line(
    tiny_models: TinyModels, capfd: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code, out, err = run_main(capfd, *generate_args(tiny_models.target, "def f(", 8, *extra))
    assert code != 0
    assert out == ""
    assert message in assert_one_error_line(err)


def test_unknown_drafter_is_an_argparse_usage_error(
    tiny_models: TinyModels, capfd: pytest.CaptureFixture[str]
) -> None:
    # argparse rejects the choice itself: usage lines, then "specserve generate: error: ..." (status 2).
    code, out, err = run_main(capfd, *generate_args(tiny_models.target, "def f(", 8, "--drafter", "magic"))
    assert code == 2
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith("specserve generate: error: argument --drafter: invalid choice: 'magic'")


def test_prompt_longer_than_the_context(tiny_models: TinyModels, tmp_path: Path) -> None:
    # As a subprocess: a small context once aborted the whole process inside llama.cpp (n_batch is capped
    # at n_ctx), which in-process would take the test session down with it.
    prompt = "hello world " * 40
    proc = run_subprocess(*generate_args(tiny_models.target, prompt, 8, "--ctx-size", "32"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    line = assert_one_error_line(proc.stderr)
    assert "prompt" in line and "32" in line


def test_small_context_generates(tiny_models: TinyModels, tmp_path: Path) -> None:
    proc = run_subprocess(*generate_args(tiny_models.target, "def f(", 8, "--ctx-size", "32"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    check_contract(json.loads(proc.stdout), 8)


@pytest.mark.parametrize("subprocess_run", [False, True])
def test_missing_target_file(tmp_path: Path, capfd: pytest.CaptureFixture[str], subprocess_run: bool) -> None:
    missing = tmp_path / "nope.gguf"
    args = generate_args(missing)
    if subprocess_run:
        proc = run_subprocess(*args, cwd=tmp_path)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        code, out, err = run_main(capfd, *args)
    assert code == 2
    assert out == ""
    assert str(missing) in assert_one_error_line(err)


def test_corrupt_target_file(
    tiny_models: TinyModels, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_models.target.read_bytes()[:20_000])
    code, out, err = run_main(capfd, *generate_args(broken))
    assert code == 2
    assert out == ""
    assert str(broken) in assert_one_error_line(err)


# -- models and config ------------------------------------------------------------------------------


def test_models_list_on_an_empty_dir(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model_dir = tmp_path / "models"
    model_dir.mkdir()
    code, out, err = run_main(capfd, "models", "list", "--model-dir", str(model_dir))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines
    assert all("missing" in line for line in lines)

    code, out, _ = run_main(capfd, "models", "list", "--model-dir", str(model_dir), "--json")
    assert code == 0
    rows = json.loads(out)
    assert {row["name"] for row in rows} >= {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
    assert list(model_dir.iterdir()) == []  # listing downloads nothing


def test_config_show_prints_json(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_MAX_RUNNING", "2")
    code, out, err = run_main(capfd, "config", "show")
    assert code == 0, err
    shown = json.loads(out)
    assert set(shown) == set(redacted(Settings())) | {"exactness"}
    assert shown["exactness"]["mode"] == "batch-invariant"  # the project's build carries the patch
    assert shown["context_size"] == Settings().context_size
    assert shown["max_running"] == 2  # from the environment

    config = tmp_path / "specserve.yaml"
    config.write_text("drafter: ngram\nnum_draft_tokens: 4\n")
    code, out, _ = run_main(capfd, "config", "show", "--config", str(config), "--num-draft-tokens", "6")
    assert code == 0
    shown = json.loads(out)
    assert (shown["drafter"], shown["num_draft_tokens"]) == ("ngram", 6)


def test_config_show_bad_file_fails_with_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "specserve.yaml"
    config.write_text("no_such_setting: 1\n")
    code, out, err = run_main(capfd, "config", "show", "--config", str(config))
    assert code == 2
    assert out == ""
    assert "no_such_setting" in assert_one_error_line(err)
