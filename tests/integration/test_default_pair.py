"""The real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft): exact-mode equality and acceptance.

Marked ``model``: needs the assembled GGUF files (``specserve models pull``; .ci/run does it) and takes a
minute or two on 2 cores.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from specserve.config import Settings
from specserve.engine.builder import build_engine
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.models import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET, ModelStore
from specserve.request import SamplingParams
from specserve.sequence import SpeculationOptions

pytestmark = pytest.mark.model

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Rename the variable `total` to `acc` and output the whole code:\n\n"
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
    "Explain in two sentences what a mutex is.",
]


@pytest.fixture(scope="module")
def engine() -> Iterator[SpeculativeEngine]:
    store = ModelStore()
    if store.locate(CATALOG[DEFAULT_TARGET]) is None or store.locate(CATALOG[DEFAULT_DRAFT]) is None:
        pytest.skip("default models not pulled (run: specserve models pull)")
    settings = Settings(drafter="draft-model", draft_policy="fixed", num_draft_tokens=6, draft_p_min=0.0)
    built, report = build_engine(dataclasses.replace(settings, max_running=2))
    assert report.drafters == ["ngram", "suffix", "draft-model"]
    assert isinstance(built.policy, FixedLengthPolicy)
    yield built
    built.close()


def _generate(
    engine: SpeculativeEngine,
    prompt: str,
    drafter: str,
    params: SamplingParams,
    num_draft_tokens: int | None = None,
) -> list[int]:
    from specserve.chat import render_chat

    text = render_chat(engine.target, [{"role": "user", "content": prompt}])
    ids = engine.target.tokenize(text, parse_special=True)
    options = SpeculationOptions(drafter=drafter, num_draft_tokens=num_draft_tokens)
    seq = engine.add_request(f"{drafter}-{num_draft_tokens}-{hash(prompt)}", ids, params, options)
    while engine.has_work():
        engine.step()
    if drafter != "none":
        _stats[drafter] = _stats.get(drafter, 0) + seq.stats.num_accepted_tokens
    return seq.output_ids


_stats: dict[str, int] = {}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_exact_mode_speculative_equals_plain(engine: SpeculativeEngine, prompt: str) -> None:
    params = SamplingParams(max_tokens=40)
    plain = _generate(engine, prompt, "none", params)
    assert _generate(engine, prompt, "draft-model", params) == plain
    assert _generate(engine, prompt, "ngram", params) == plain
    # Verify passes of up to 17 rows: past ggml's 8-row kernel switch and the 7-row cap exact mode needed
    # before the batch-invariant patch.
    assert _generate(engine, prompt, "ngram", params, num_draft_tokens=16) == plain


def test_draft_model_is_accepted(engine: SpeculativeEngine) -> None:
    assert _stats.get("draft-model", 0) > 0


def test_sampled_generation_is_seeded(engine: SpeculativeEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=1)
    a = _generate(engine, PROMPTS[0], "draft-model", params)
    b = _generate(engine, PROMPTS[0], "draft-model", params)
    assert a == b


def test_concurrent_requests_match_solo_runs(engine: SpeculativeEngine) -> None:
    """Two requests batched together (their verify rows share one call) give what each gives alone."""
    from specserve.chat import render_chat

    params = SamplingParams(max_tokens=24)
    solo = [_generate(engine, p, "none", params) for p in PROMPTS[:2]]
    seqs = []
    for i, (prompt, drafter) in enumerate(zip(PROMPTS[:2], ("draft-model", "ngram"), strict=True)):
        ids = engine.target.tokenize(
            render_chat(engine.target, [{"role": "user", "content": prompt}]), parse_special=True
        )
        seqs.append(engine.add_request(f"batched-{i}", ids, params, SpeculationOptions(drafter=drafter)))
    while engine.has_work():
        engine.step()
    assert [s.output_ids for s in seqs] == solo


def test_prefix_cache_hit_on_the_next_turn_changes_nothing(engine: SpeculativeEngine) -> None:
    """Turn 2 reuses turn 1's prompt and generated KV, and generates what a cold run (new salt) does."""
    from specserve.chat import render_chat

    def run(messages: list[dict[str, str]], salt: str, drafter: str) -> tuple[list[int], int, int]:
        ids = engine.target.tokenize(render_chat(engine.target, messages), parse_special=True)
        params = SamplingParams(max_tokens=32)
        seq = engine.add_request(
            f"turn-{salt}-{drafter}-{len(ids)}", ids, params, SpeculationOptions(drafter=drafter), salt
        )
        while engine.has_work():
            engine.step()
        return seq.output_ids, seq.cached_tokens, len(ids)

    history = [{"role": "user", "content": PROMPTS[1]}]
    first, _, first_len = run(history, "multi-turn", "none")
    history += [
        {"role": "assistant", "content": engine.target.detokenize(first)},
        {"role": "user", "content": "Now rename `xs` to `values` as well."},
    ]
    cached, hit, _ = run(history, "multi-turn", "ngram")
    cold, cold_hit, _ = run(history, "cold", "ngram")
    assert cold_hit == 0 and hit > first_len  # the previous answer's KV was reused too
    assert cached == cold
