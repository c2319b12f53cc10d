"""``specserve bench --in-process --fresh-process`` on the tiny models: every run a new generate process."""

from __future__ import annotations

from specserve.config import Settings
from specserve.tools.measure.fresh_generate import (
    generate_args,
    measure_fresh_generate,
    render_fresh_generate,
)
from support.tiny_models import TinyModels


def test_each_prompt_and_mode_is_a_fresh_generate_process(tiny_models: TinyModels) -> None:
    settings = Settings(target=str(tiny_models.target), draft="none", threads=1).validate()
    prompts = [{"kind": "howto", "prompt": "hello hello hello hello"}]
    data = measure_fresh_generate(settings, prompts, max_tokens=12, rounds=2)
    (row,) = data["prompts"]
    assert row["kind"] == "howto" and row["tokens"] > 0
    assert len(row["plain_tok_s"]) == len(row["auto_tok_s"]) == len(row["ratios"]) == 2
    assert row["ratio"] > 0 and row["identical"]  # greedy: auto's output is plain's
    assert "--drafter" not in data["generate_args"] and "--threads" in data["generate_args"]
    text = render_fresh_generate(data, "specserve bench --in-process --fresh-process")
    assert "| howto |" in text and "Lowest ratio" in text


def test_the_fresh_processes_repeat_this_runs_engine_flags() -> None:
    settings = Settings(target="t.gguf", draft="d.gguf", threads=2, exact=False, num_draft_tokens=8)
    args = generate_args(settings)
    for flag, value in (("--target", "t.gguf"), ("--draft", "d.gguf"), ("--threads", "2")):
        assert args[args.index(flag) + 1] == value
    assert "--no-exact" in args and args[args.index("--num-draft-tokens") + 1] == "8"


def test_paired_rounds_decode_both_modes_in_one_fresh_process(tiny_models: TinyModels) -> None:
    settings = Settings(target=str(tiny_models.target), draft="none", threads=1).validate()
    prompts = [{"kind": "list", "prompt": "one two three one two three one two three"}]
    data = measure_fresh_generate(settings, prompts, max_tokens=12, rounds=2, paired=True)
    (row,) = data["prompts"]
    assert data["paired"] and len(row["ratios"]) == len(row["drafts"]) == 2
    assert row["identical"] and row["tokens"] > 0  # auto's first request decoded what plain decoded
    assert all(x > 0 for x in row["plain_tok_s"] + row["auto_tok_s"])
    assert "first speculative request" in render_fresh_generate(data, "bench --fresh-process --paired")
