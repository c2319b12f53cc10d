"""Prompt logprobs on tiny real models: every prompt token's logprob from the prefill pass, equal to the
target's own distribution, unchanged by speculation, by other requests in the batch and by a prefix-cache
hit; ``max_tokens`` 0 evaluates the prompt only."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from specserve.backends.base import DecodeChunk
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.suffix import SuffixDrafter
from specserve.engine.cost_model import CostModel, StepCostTable
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.engine.prefix_cache import PrefixCache
from specserve.request import SamplingParams
from specserve.sequence import Sequence, SpeculationOptions
from specserve.verify.logprobs import PromptLogprob
from support.quantized import tiny_kquant_model

TEXT = "def add(self, other):\n    return self.value + other.value\n" * 3
ASKING = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=3)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_kquant_model(tmp_path_factory.mktemp("kquant"))


@contextmanager
def make_engine(path: Path, *, cache: bool = True, prefill: int = 16) -> Iterator[SpeculativeEngine]:
    """Two slots, small prefill chunks (a prompt takes several), n-gram and suffix drafts of 4."""
    target = LlamaCppRuntime(path, context_per_sequence=512, max_sequences=2, n_threads=1)
    grid = prefill if target.info.exactness == "capped" else None
    prefix = PrefixCache(target, host_bytes=64 * 2**20, grid=grid) if cache else None
    drafters = {"ngram": NgramDrafter(), "suffix": SuffixDrafter(min_prob=0.0, factor=4.0)}
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 64: 64.0}))
    options = EngineOptions(("ngram", "suffix"), 4)
    engine = SpeculativeEngine(target, drafters, FixedLengthPolicy(), costs, options, prefill, prefix)
    try:
        yield engine
    finally:
        engine.close()


def _oracle(path: Path, ids: list[int]) -> np.ndarray:
    """log-softmax (float64) of the target's rows over the whole prompt, in one call of its own."""
    runtime = LlamaCppRuntime(path, context_per_sequence=512, max_sequences=1, n_threads=1)
    try:
        rows = np.array(runtime.decode([DecodeChunk(0, ids, 0, len(ids))])[0], dtype=np.float64)
    finally:
        runtime.close()
    peak = rows.max(axis=-1, keepdims=True)
    result: np.ndarray = rows - peak - np.log(np.exp(rows - peak).sum(axis=-1, keepdims=True))
    return result


def _entries(seq: Sequence) -> list[PromptLogprob]:
    assert seq.prompt_logprobs[0] is None
    entries = seq.prompt_logprobs[1:]
    assert all(isinstance(e, PromptLogprob) for e in entries)
    return entries  # type: ignore[return-value]


def _run(engine: SpeculativeEngine, requests: list[tuple[list[int], SamplingParams, str]]) -> list[Sequence]:
    """Run requests together; request ids stay unique over the engine's life."""
    seqs = [
        engine.add_request(f"r{id(ids)}-{i}-{drafter}", ids, params, SpeculationOptions(drafter=drafter))
        for i, (ids, params, drafter) in enumerate(requests)
    ]
    while engine.has_work():
        engine.step()
    return seqs


def test_prompt_logprobs_are_the_targets_distribution_over_chunked_prefill(q4_k_m: Path) -> None:
    with make_engine(q4_k_m, cache=False) as engine:  # several chunks per prompt
        ids = engine.target.tokenize(TEXT)
        (seq,) = _run(engine, [(ids, ASKING, "none")])
    oracle = _oracle(q4_k_m, ids)
    entries = _entries(seq)
    assert len(seq.prompt_logprobs) == len(ids)
    for j, entry in enumerate(entries):  # entry j is prompt token j + 1, from row j
        token = ids[j + 1]
        assert entry.entry.token_id == token
        assert entry.entry.logprob == pytest.approx(oracle[j, token], abs=1e-4)
        assert entry.rank == 1 + int((oracle[j] > oracle[j, token]).sum())
        best = [t for t, _ in entry.entry.top]
        assert len(best) == 3 and best[0] == int(np.argmax(oracle[j]))
    assert len({e.rank for e in entries}) > 1  # a random tiny model: ranks vary, rarely 1


def test_unchanged_by_speculation_batching_and_a_prefix_cache_hit(q4_k_m: Path) -> None:
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    with make_engine(q4_k_m) as engine:
        ids = engine.target.tokenize(TEXT)
        other = engine.target.tokenize("x = [i * i for i in range(10)]\n" * 4)
        (alone,) = _run(engine, [(ids, ASKING, "none")])
        (no_logprobs,) = _run(engine, [(ids, plain, "none")])
        drafted, neighbour = _run(engine, [(ids, ASKING, "suffix"), (other, plain, "ngram")])
        again = _run(engine, [(ids, ASKING, "ngram")])[0]  # the prompt's KV is cached by now
    assert no_logprobs.cached_tokens > 0 and again.cached_tokens == 0  # asking skips the cache
    assert drafted.stats.num_drafts > 0
    reference = [(e.entry, e.rank) for e in _entries(alone)]
    for seq in (drafted, again):
        assert [(e.entry, e.rank) for e in _entries(seq)] == reference
        assert seq.output_ids == alone.output_ids == no_logprobs.output_ids
    assert not neighbour.prompt_logprobs


def test_max_tokens_zero_evaluates_the_prompt_only(q4_k_m: Path) -> None:
    with make_engine(q4_k_m) as engine:
        ids = engine.target.tokenize(TEXT)
        (full,) = _run(engine, [(ids, ASKING, "none")])
        (only,) = _run(engine, [(ids, dataclasses.replace(ASKING, max_tokens=0), "ngram")])
        (after,) = _run(engine, [(ids, SamplingParams(max_tokens=4), "none")])
    assert only.output_ids == [] and only.finish_reason == "length"
    assert [e.entry for e in _entries(only)] == [e.entry for e in _entries(full)]
    assert after.output_ids == full.output_ids[:4]  # the engine goes on serving
