"""Prefix caching on tiny real models: a cache hit never changes greedy output, and the cache stays bounded.

The K-quant model reaches the kernels whose rounding depends on the batch size (repacked Q4_K gemv/gemm, Q6_K
vec_dot/tiled), so "equal with and without the cache" there means the reused KV — prompt chunks and the
previous turn's generated tokens — is bit for bit what a cold run computes.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from specserve.backends import llama_cpp
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.drafters.base import Drafter
from specserve.drafters.draft_model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.suffix import SuffixDrafter
from specserve.engine.cost_model import CostModel, StepCostTable
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.engine.prefix_cache import BLOCK_SIZE, PrefixCache, block_hashes
from specserve.request import SamplingParams
from specserve.sequence import Sequence, SpeculationOptions
from support.quantized import tiny_kquant_model
from support.tiny_models import TinyModels

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
TEXT = "def add(self, other):\n    return self.value + other.value\n" * 3


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_kquant_model(tmp_path_factory.mktemp("kquant"))


@contextmanager
def make_engine(
    path: Path,
    *,
    cache: bool = True,
    slots: int = 2,
    host_mib: float = 64,
    prefill: int = 256,
    draft: Path | None = None,
) -> Iterator[SpeculativeEngine]:
    target = LlamaCppRuntime(path, context_per_sequence=512, max_sequences=slots, n_threads=1)
    grid = prefill if target.info.exactness == "capped" else None
    prefix = PrefixCache(target, host_bytes=int(host_mib * 2**20), grid=grid) if cache else None
    drafters: dict[str, Drafter] = {"ngram": NgramDrafter(), "suffix": SuffixDrafter()}
    if draft is not None:
        runtime = LlamaCppRuntime(draft, context_per_sequence=512, max_sequences=slots, n_threads=1)
        drafters["draft-model"] = DraftModelDrafter(runtime, p_min=0.0)
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 64: 64.0}))
    engine = SpeculativeEngine(
        target, drafters, FixedLengthPolicy(), costs, EngineOptions(("ngram",), 4), prefill, prefix
    )
    try:
        yield engine
    finally:
        engine.close()


def run(
    engine: SpeculativeEngine, prompts: list[list[int]], salt: str = "", drafter: str = "none"
) -> list[Sequence]:
    """Run prompts one after another (each request finishes before the next starts)."""
    seqs: list[Sequence] = []
    for ids in prompts:
        seq = engine.add_request(
            f"r{len(seqs)}-{id(ids)}", ids, GREEDY, SpeculationOptions(drafter=drafter), salt
        )
        while engine.has_work():
            engine.step()
        seqs.append(seq)
    return seqs


def cold(path: Path, ids: list[int], drafter: str = "none") -> list[int]:
    with make_engine(path, cache=False) as engine:
        return run(engine, [ids], drafter=drafter)[0].output_ids


def test_block_hashes_chain_whole_prefixes_and_salts() -> None:
    a = list(range(40))
    hashes = block_hashes(a)
    assert len(hashes) == 40 // BLOCK_SIZE
    assert block_hashes(a[:32]) == hashes  # a hash names the whole prefix up to its block
    changed = [99, *a[1:]]
    assert not set(block_hashes(changed)) & set(hashes)  # an early difference changes every later hash
    assert not set(block_hashes(a, salt="tenant-b")) & set(hashes)


@pytest.mark.parametrize("drafter", ["none", "ngram", "suffix"])
def test_second_turn_reuses_history_and_output_is_unchanged(q4_k_m: Path, drafter: str) -> None:
    with make_engine(q4_k_m) as engine:
        ids = engine.target.tokenize(TEXT)
        first = run(engine, [ids], drafter=drafter)[0]
        turn2 = ids + first.output_ids + engine.target.tokenize("\n# next\n", add_special=False)
        second = run(engine, [turn2], drafter=drafter)[0]
    assert engine.target.info.exactness == "batch-invariant"
    # The slot held the prompt and every generated token but the pending last one.
    assert second.cached_tokens == len(ids) + len(first.output_ids) - 1
    assert second.cached_tokens > len(ids)  # generated tokens' KV was reused too
    assert second.output_ids == cold(q4_k_m, turn2, drafter)


def test_shared_prefix_is_copied_from_a_running_sequence(q4_k_m: Path) -> None:
    with make_engine(q4_k_m, slots=3) as engine:
        ids = engine.target.tokenize(TEXT)
        a = engine.add_request("a", [*ids, 11, 12], SamplingParams(max_tokens=40, ignore_eos=True))
        while not a.output_ids:
            engine.step()
        b = engine.add_request("b", [*ids, 13, 14], GREEDY)
        while engine.has_work():
            engine.step()
    assert b.slot != a.slot and b.cached_tokens == len(ids)  # up to where the prompts part
    assert b.output_ids == cold(q4_k_m, [*ids, 13, 14])


def test_a_wave_of_requests_runs_on_consecutive_slots_and_copies_prefixes_there(q4_k_m: Path) -> None:
    # The default pair at concurrency 4 ran its second wave on slots 0, 1, 4, 5: two prompts took their
    # cached prefixes in place, the other two the empty slots, and every step became two llama.cpp passes.
    with make_engine(q4_k_m, slots=8) as engine:
        prompts = [engine.target.tokenize(f"# part {i}\n" + TEXT) for i in range(4)]
        first = [engine.add_request(f"w1-{i}", ids, GREEDY) for i, ids in enumerate(prompts)]
        while engine.has_work():
            engine.step()
        assert sorted(s.slot for s in first) == [0, 1, 2, 3]
        fresh = [engine.target.tokenize(f"{word} " * 40) for word in ("apple", "pear")]
        second = [
            engine.add_request("w2-a", [*prompts[0], 7], GREEDY),
            engine.add_request("w2-b", [*prompts[1], 8], GREEDY),
            engine.add_request("w2-c", fresh[0], GREEDY),
            engine.add_request("w2-d", fresh[1], GREEDY),
        ]
        engine.step()
        slots = sorted(s.slot for s in second)
        assert slots == list(range(slots[0], slots[0] + 4))
        assert engine.target.call_rows([1] * 4, slots) == [4]  # one pass
        assert second[0].cached_tokens == len(prompts[0]) and second[1].cached_tokens == len(prompts[1])
        while engine.has_work():
            engine.step()
    assert second[1].output_ids == cold(q4_k_m, [*prompts[1], 8])


def test_evicted_prefix_comes_back_from_host_ram(q4_k_m: Path) -> None:
    with make_engine(q4_k_m, slots=1) as engine:
        ids = engine.target.tokenize(TEXT)
        other = engine.target.tokenize("Something else entirely, " * 6)
        seqs = run(engine, [ids, other, [*ids, 5]])
        cache = engine.prefix_cache
        assert cache is not None and cache.stats.host_saves >= 1
    assert seqs[1].cached_tokens == 0
    assert seqs[2].cached_tokens == len(ids)
    assert seqs[2].output_ids == cold(q4_k_m, [*ids, 5])


def test_a_corrupted_host_blob_is_dropped_not_loaded(q4_k_m: Path, caplog: pytest.LogCaptureFixture) -> None:
    with make_engine(q4_k_m, slots=1) as engine:
        ids = engine.target.tokenize(TEXT)
        other = engine.target.tokenize("Something else entirely, " * 6)
        run(engine, [ids, other])
        cache = engine.prefix_cache
        assert cache is not None
        (holder,) = cache.host_entries()
        holder.blob = holder.blob[:100] + bytes([holder.blob[100] ^ 0xFF]) + holder.blob[101:]
        with caplog.at_level(logging.WARNING, "specserve.prefix_cache"):
            (again,) = run(engine, [[*ids, 5]])
        assert cache.stats.host_drops == 1 and all(h is not holder for h in cache.host_entries())
    assert "checksum" in caplog.text
    assert again.cached_tokens == 0 and again.output_ids == cold(q4_k_m, [*ids, 5])


def test_a_blob_that_does_not_load_is_dropped(q4_k_m: Path) -> None:
    with make_engine(q4_k_m, slots=1) as engine:
        ids = engine.target.tokenize(TEXT)
        run(engine, [ids, engine.target.tokenize("Something else entirely, " * 6)])
        cache = engine.prefix_cache
        assert cache is not None
        (holder,) = cache.host_entries()
        holder.blob = holder.blob[: len(holder.blob) // 2]  # truncated, with a matching checksum
        holder.checksum = zlib.crc32(holder.blob)
        (again,) = run(engine, [[*ids, 5]])
        assert cache.stats.host_drops == 1
    assert again.cached_tokens == 0 and again.output_ids == cold(q4_k_m, [*ids, 5])


def test_salts_isolate_tenants(tiny_models: TinyModels) -> None:
    with make_engine(tiny_models.target) as engine:
        ids = engine.target.tokenize(TEXT)
        first, other_tenant, same_tenant = (
            run(engine, [[*ids, 1]], salt="a")[0],
            run(engine, [[*ids, 2]], salt="b")[0],
            run(engine, [[*ids, 3]], salt="a")[0],
        )
    assert first.cached_tokens == other_tenant.cached_tokens == 0
    assert same_tenant.cached_tokens > 0


def test_host_tier_stays_within_its_budget(tiny_models: TinyModels) -> None:
    with make_engine(tiny_models.target, slots=1, host_mib=0.05) as engine:
        budget = engine.prefix_cache.host_bytes if engine.prefix_cache else 0
        prompts = [engine.target.tokenize(f"request {i}: " + TEXT) for i in range(6)]
        for ids in prompts:
            run(engine, [ids])
            assert engine.prefix_cache is not None
            assert engine.prefix_cache.host_tier_bytes() <= budget
        assert engine.prefix_cache is not None and engine.prefix_cache.stats.host_saves >= 2


def test_capped_mode_reuses_whole_prefill_chunks_only(q4_k_m: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_cpp, "build_is_batch_invariant", lambda: False)
    with make_engine(q4_k_m, prefill=16) as engine:
        assert engine.target.info.exactness == "capped"
        ids = engine.target.tokenize(TEXT)
        first = run(engine, [ids])[0]
        turn2 = ids + first.output_ids + [7]
        second = run(engine, [turn2])[0]
    # Only prompt tokens computed in whole 16-token prefill chunks; none of the generated tokens.
    assert second.cached_tokens == len(ids) // 16 * 16
    with make_engine(q4_k_m, cache=False, prefill=16) as engine:
        assert run(engine, [turn2])[0].output_ids == second.output_ids


def test_no_cache_frees_kv_at_the_end(tiny_models: TinyModels) -> None:
    with make_engine(tiny_models.target, cache=False) as engine:
        ids = engine.target.tokenize(TEXT)
        run(engine, [ids])
        assert all(engine.target.kv_positions(s) == 0 for s in range(2))


def test_draft_model_starts_from_its_slots_leftover(tiny_models: TinyModels) -> None:
    with make_engine(tiny_models.target, slots=1, draft=tiny_models.draft_close) as engine:
        drafter = engine.drafters["draft-model"]
        assert isinstance(drafter, DraftModelDrafter)
        ids = engine.target.tokenize(TEXT)
        (first,) = run(engine, [ids], drafter="draft-model")
        left = drafter.leftover(first.slot)
        assert left and left == first.tokens[: len(left)]
        turn2 = ids + first.output_ids + [9, 9]
        seq = engine.add_request("t2", turn2, GREEDY, SpeculationOptions(drafter="draft-model"))
        engine.step()  # admission and prefill of the uncached tail
        engine.step()  # the first draft: catch-up starts from the leftover, not from 0
        state = seq.drafter_state["draft-model"]
        assert state.placed and state.computed >= len(left)  # type: ignore[attr-defined]
        while engine.has_work():
            engine.step()
    with make_engine(tiny_models.target, cache=False, draft=tiny_models.draft_close) as engine:
        assert run(engine, [turn2], drafter="draft-model")[0].output_ids == seq.output_ids


def test_a_candidate_evicted_by_the_victims_save_is_skipped_regression_soak_keyerror(
    tiny_models: TinyModels,
) -> None:
    # Found by the soak: the host blob holding a request's prefix was evicted (LRU) to make room for the
    # chosen slot's own save, then looked up: KeyError, and the engine thread died.
    with make_engine(tiny_models.target, slots=1) as engine:
        cache = engine.prefix_cache
        assert cache is not None
        a = engine.target.tokenize(TEXT)
        b = engine.target.tokenize("#" + TEXT)  # as long as a, another prefix
        run(engine, [a, b])  # a's KV is saved to the host tier when b takes the only slot
        (blob,) = [h.blob for h in cache.host_entries()]
        cache.host_bytes = int(len(blob) * 1.5)  # room for one blob: saving b's evicts a's
        (c,) = run(engine, [[*a, 5]])
        assert c.cached_tokens == 0 and c.finish_reason == "length"  # a cold run, not a dead engine
    assert c.output_ids == cold(tiny_models.target, [*a, 5])
