"""Where the tiled K-quant kernel takes over from vec_dot: the choice, its measurement, and who may set it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from specserve.backends import llama_cpp, llama_cpp_tiled
from specserve.backends.base import DecodeChunk
from specserve.backends.invariance import check_tokens
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.backends.llama_cpp_tiled import (
    CANDIDATES,
    SIZES,
    TILED_SETTING,
    choose,
    measure_tiled_min_batch,
    set_tiled_min_batch,
    tiled_min_batch,
)
from support.quantized import tiny_kquant_model


def ratios(**by_rows: float) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds of (tiled, vec_dot) calls whose tiled / vec_dot ratio is given per size (r8=1.3, ...)."""
    tiled = {int(name[1:]): 0.1 * ratio for name, ratio in by_rows.items()}
    return tiled, {n: 0.1 for n in tiled}


@pytest.mark.parametrize(
    ("by_rows", "start"),
    [
        ({"r8": 1.3, "r12": 0.95, "r16": 0.9, "r24": 0.9}, 12),  # Zen 4-like: a cliff at 8 rows
        ({"r8": 0.9, "r12": 0.8, "r16": 0.75, "r24": 0.7}, 8),  # Zen 5, AVX-512: tiled pays at once
        ({"r8": 1.2, "r12": 1.1, "r16": 1.05, "r24": 1.04}, 32),  # never within the measured sizes
        ({"r8": 1.02, "r12": 1.0, "r16": 1.2, "r24": 0.9}, 24),  # a slower size above resets the start
    ],
)
def test_the_start_is_where_tiled_is_no_slower_at_every_larger_size(
    by_rows: dict[str, float], start: int
) -> None:
    assert choose(*ratios(**by_rows)) == start


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaCppRuntime]:
    path: Path = tiny_kquant_model(tmp_path_factory.mktemp("kquant"), "Q4_K_M")
    opened = LlamaCppRuntime(path, n_threads=1, context_per_sequence=256, max_sequences=2)
    yield opened
    opened.close()


@pytest.fixture
def restored() -> Iterator[None]:
    before = tiled_min_batch()
    assert before is not None
    yield
    set_tiled_min_batch(before)


def test_the_start_a_program_sets_is_the_one_llama_cpp_computes_with(tmp_path: Path, restored: None) -> None:
    """Seen in the logits: Q5_K has no batch-invariant pair of kernels, so a 12-row batch differs from
    one-token decoding exactly when its rows take the tiled kernel. (A wheel holds three copies of
    libggml-cpu; a setter reaching another copy than llama.cpp's would pass a getter test and change
    nothing.)"""
    path = tiny_kquant_model(tmp_path, "Q5_K_M")
    q5 = LlamaCppRuntime(path, n_threads=1, context_per_sequence=64, exact=False)
    try:
        tokens = check_tokens(q5, 16)
        context, rows = tokens[:4], tokens[4:]
        q5.decode([DecodeChunk(0, context, 0, 0)])
        alone = np.stack(
            [q5.decode([DecodeChunk(0, [t], 4 + i, 1)])[0][0].copy() for i, t in enumerate(rows)]
        )

        def batched_equals_alone() -> bool:
            q5.truncate(0, 4)
            return bool(np.array_equal(q5.decode([DecodeChunk(0, rows, 4, len(rows))])[0], alone))

        set_tiled_min_batch(1 << 30)
        assert batched_equals_alone()
        set_tiled_min_batch(8)
        assert not batched_equals_alone()
    finally:
        q5.close()


def test_measuring_sets_a_candidate_and_leaves_the_scratch_sequence_empty(
    runtime: LlamaCppRuntime, restored: None
) -> None:
    choice = measure_tiled_min_batch(runtime, 1, repeats=1)
    assert choice.rows in CANDIDATES and tiled_min_batch() == choice.rows
    assert set(choice.tiled_seconds) == set(choice.vec_dot_seconds) == set(SIZES)
    assert all(s > 0 for s in [*choice.tiled_seconds.values(), *choice.vec_dot_seconds.values()])
    assert runtime.kv_positions(1) == 0


def test_the_runtime_tunes_and_restores_its_start(
    runtime: LlamaCppRuntime, restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(llama_cpp_tiled.ENVIRONMENT, raising=False)
    tuned = runtime.tune_kernels(1)
    assert tuned == {TILED_SETTING: tiled_min_batch()}
    runtime.restore_kernels({TILED_SETTING: 24, "unknown": 3})
    assert tiled_min_batch() == 24


def test_a_start_the_environment_chose_is_never_measured_over(
    runtime: LlamaCppRuntime, restored: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(llama_cpp_tiled.ENVIRONMENT, "8")
    set_tiled_min_batch(8)
    monkeypatch.setattr(llama_cpp, "measure_tiled_min_batch", lambda *a: pytest.fail("measured"))
    assert runtime.tune_kernels(1) == {}
    runtime.restore_kernels({TILED_SETTING: 24})
    assert tiled_min_batch() == 8
