"""``python -m benchmarks.fresh_generate`` on the tiny models: every run a new generate process."""

from __future__ import annotations

from bench_env import isolated_env  # noqa: F401  (autouse)

from benchmarks.fresh_generate import (
    generate_args,
    measure_fresh_generate,
    render_fresh_generate,
)
from benchmarks.fresh_pair import DecodeStep, within_request
from specserve.config import Settings
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
    text = render_fresh_generate(data, "python -m benchmarks.fresh_generate")
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
    assert len(row["within_request"]) == 2 and all(0.0 < x < 10.0 for x in row["within_request"])
    text = render_fresh_generate(data, "python -m benchmarks.fresh_generate --paired")
    assert "first speculative request" in text and "Within request" in text


def test_within_request_prices_drafting_steps_at_the_requests_plain_step() -> None:
    plain = [DecodeStep(0.030, 0, 1)] * 5
    gained = [*plain, DecodeStep(0.060, 1, 4)]  # 4 tokens for 2 steps: 2 steps (60 ms) gained
    result = within_request(gained, [], decode_ms=210.0)
    assert result["drafting_steps"] == 1 and result["plain_step_ms"] == 30.0
    assert result["net_ms"] == -60.0 and result["ratio"] == round(0.27 / 0.21, 4)
    lost = [*plain, DecodeStep(0.075, 1, 1)]  # a rejected draft: 1 token for 2.5 steps
    assert within_request(lost, [], decode_ms=225.0)["ratio"] == round(0.18 / 0.225, 4)
    # Drafting at every step: the plain decode of the same prompt gives the plain step.
    copying = [DecodeStep(0.050, 1, 5)] * 2
    assert within_request(copying, plain, decode_ms=100.0)["net_ms"] == -200.0
