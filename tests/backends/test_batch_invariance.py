"""Batch invariance on K-quant models: the patched ggml kernels, the load-time self-check, and its fallback.

The tiny f32/f16/q8_0 models cannot see ggml's batch-size kernel switches; these tests quantize a tiny model
with llama.cpp's own quantizer (Q4_K_M: repacked Q4_K gemv/gemm, Q6_K vec_dot/tiled) and compare logits
with ``np.array_equal``, never with a tolerance. They fail if the batch-invariant patch is lost from the
build: stock ggml differs from 4 rows on (repacked Q4_K) and from 8 rows on (Q6_K).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from specserve.backends import invariance, llama_cpp
from specserve.backends.base import DecodeChunk
from specserve.backends.invariance import InvarianceResult, check_batch_invariance, check_tokens
from specserve.backends.llama_cpp import (
    EXACT_MAX_ROWS,
    LlamaCppRuntime,
    _features,
    build_is_batch_invariant,
    uses_flash_attention,
)
from specserve.backends.llama_cpp_tiled import set_tiled_min_batch, tiled_min_batch
from support.quantized import tensor_types, tiny_kquant_model

Logits = npt.NDArray[np.float32]
OpenRuntime = Callable[..., LlamaCppRuntime]
MAX_ROWS = 40  # past the build's tiled threshold (32), the 16-row gemm blocks twice


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_kquant_model(tmp_path_factory.mktemp("kquant"), "Q4_K_M")


@pytest.fixture
def open_runtime(q4_k_m: Path) -> Iterator[OpenRuntime]:
    opened: list[LlamaCppRuntime] = []

    def factory(path: Path | None = None, **kwargs: object) -> LlamaCppRuntime:
        options: dict[str, object] = {"n_threads": 1, "context_per_sequence": 1024, "max_sequences": 2}
        runtime = LlamaCppRuntime(path or q4_k_m, **(options | kwargs))  # type: ignore[arg-type]
        opened.append(runtime)
        return runtime

    yield factory
    for runtime in opened:
        runtime.close()


def one_token_steps(runtime: LlamaCppRuntime, seq: int, tokens: list[int], start: int) -> Logits:
    """Logits of ``tokens`` decoded one per call from position ``start`` (plain decoding)."""
    rows = [runtime.decode([DecodeChunk(seq, [t], start + i, 1)])[0][0].copy() for i, t in enumerate(tokens)]
    return np.stack(rows)


def test_the_model_reaches_both_kernel_switches(q4_k_m: Path) -> None:
    types = tensor_types(q4_k_m)
    assert types["output.weight"] == "Q6_K"
    assert {types["blk.0.ffn_down.weight"], types["blk.1.ffn_down.weight"]} == {"Q4_K", "Q6_K"}
    assert types["blk.0.attn_q.weight"] == "Q4_K"


def test_the_build_carries_the_patch() -> None:
    assert build_is_batch_invariant(), (
        "llama-cpp-python was built without patches/llama.cpp-batch-invariant.patch"
    )


def test_the_build_reports_its_tiled_threshold_and_takes_the_environment_over_it() -> None:
    """The patch moves the tiled kernel's start to a build option (the 8-row cost cliff, docs/BENCHMARKS.md)
    and reports it; the self-check sizes its batch by it."""
    configured = re.search(r"GGML_CPU_TILED_MIN_BATCH=(\d+)", Path("scripts/build-llama-cpp.sh").read_text())
    assert configured is not None
    assert f"TILED_MIN_BATCH = {configured.group(1)} " in _features()
    code = "from specserve.backends.llama_cpp_tiled import tiled_min_batch; print(tiled_min_batch())"
    env = os.environ | {"GGML_CPU_TILED_MM_MIN_BATCH": "8"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "8"
    env.pop("GGML_CPU_TILED_MM_MIN_BATCH")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == configured.group(1)


def test_a_program_moves_the_tiled_threshold_at_run_time() -> None:
    before = tiled_min_batch()
    assert before is not None
    try:
        set_tiled_min_batch(12)
        assert tiled_min_batch() == 12
        set_tiled_min_batch(0)  # back to the build's (or the environment's) value
        assert f"TILED_MIN_BATCH = {tiled_min_batch()} " in _features()
    finally:
        set_tiled_min_batch(before)


@pytest.mark.parametrize(("threshold", "rows"), [(None, 16), (8, 16), (32, 37), (64, 69)])
def test_the_self_check_batch_reaches_the_tiled_kernel_and_every_gemm_block(
    threshold: int | None, rows: int
) -> None:
    assert invariance.check_rows(threshold) == rows


def test_the_load_time_self_check_ran_a_batch_past_the_tiled_threshold(open_runtime: OpenRuntime) -> None:
    runtime = open_runtime()
    threshold = tiled_min_batch()
    assert threshold is not None
    # check_rows: threshold + 5, and at least 16 (a tuned start of 8 from another test's load stays set)
    rows = invariance.check_rows(threshold)
    assert (
        rows >= threshold + 5 and f"{rows}-row batch equals one-token decoding" in runtime.info.exactness_note
    )


@pytest.fixture(params=[None, 8], ids=["build-threshold", "tiled-from-8"])
def tiled_start(request: pytest.FixtureRequest) -> Iterator[None]:
    """The build's tiled threshold, and the tiled kernel from 8 rows (vec_dot against tiled at 8-40 rows)."""
    before = tiled_min_batch()
    assert before is not None
    set_tiled_min_batch(request.param or before)
    yield
    set_tiled_min_batch(before)


@pytest.mark.parametrize("flash", ["on", "off"])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_of_every_batch_size_equals_one_token_decoding(
    open_runtime: OpenRuntime, threads: int, tiled_start: None, flash: str
) -> None:
    every_row_equals_one_token_decoding(open_runtime(n_threads=threads, flash_attention=flash), 40)


@pytest.mark.parametrize("flash", ["on", "off"])
def test_rows_that_cross_a_kv_padding_boundary_equal_one_token_decoding(
    open_runtime: OpenRuntime, flash: str
) -> None:
    """llama.cpp pads the attended cache to 256 cells: at 250 cached tokens one token attends to 256, a batch
    of 7 or more to 512, the extra cells masked. Plain attention adds their zero weights into its sums."""
    every_row_equals_one_token_decoding(open_runtime(n_threads=2, flash_attention=flash), 250)


def every_row_equals_one_token_decoding(runtime: LlamaCppRuntime, cached: int) -> None:
    assert runtime.info.exactness == "batch-invariant", runtime.info.exactness_note
    tokens = check_tokens(runtime, cached + MAX_ROWS)
    context, probe = tokens[:cached], tokens[cached:]
    runtime.decode([DecodeChunk(0, context, 0, 0)])
    plain = one_token_steps(runtime, 0, probe, len(context))
    for n in range(1, MAX_ROWS + 1):
        runtime.truncate(0, len(context))
        batched = runtime.decode([DecodeChunk(0, probe[:n], len(context), n)])[0]
        for row in range(n):
            assert np.array_equal(batched[row], plain[row]), f"row {row} of a {n}-row batch"


@pytest.mark.parametrize("flash", ["on", "off"])
def test_prompt_prefill_in_any_chunking_and_mixed_sequences_are_exact(
    open_runtime: OpenRuntime, flash: str
) -> None:
    """A prompt decoded in uneven pieces beside another sequence's verify rows gives the same KV as alone
    (the batch's other sequence also sets how many cache cells everyone attends to)."""
    runtime = open_runtime(flash_attention=flash)
    tokens = check_tokens(runtime, 300)
    prompt, probe = tokens[:280], tokens[280:]
    runtime.decode([DecodeChunk(0, prompt, 0, 0)])
    reference = one_token_steps(runtime, 0, probe, len(prompt))
    runtime.free(0)
    # Pieces of 13, 100, 167 rows; the second sequence verifies 11 rows in the same calls.
    other = check_tokens(runtime, 60)[::-1]
    runtime.decode([DecodeChunk(1, other[:49], 0, 0)])
    lo = 0
    for size in (13, 100, 167):
        runtime.decode([DecodeChunk(0, prompt[lo : lo + size], lo, 0), DecodeChunk(1, other[49:], 49, 11)])
        runtime.truncate(1, 49)
        lo += size
    both = runtime.decode(
        [DecodeChunk(0, probe, len(prompt), len(probe)), DecodeChunk(1, other[49:], 49, 11)]
    )
    assert np.array_equal(both[0], reference)


def test_self_check_passes_on_the_patched_build(open_runtime: OpenRuntime) -> None:
    runtime = open_runtime()
    result = check_batch_invariance(runtime)
    assert result.ok and result.rows == invariance.CHECK_ROWS and result.max_abs_diff == 0.0
    assert "bit for bit" in runtime.info.exactness_note
    assert runtime.info.max_verify_tokens > MAX_ROWS


def test_a_model_the_patch_does_not_cover_falls_back_to_capped(
    open_runtime: OpenRuntime, tmp_path: Path
) -> None:
    """Q5_K has no batch-invariant pair of kernels (vec_dot below 8 rows, tiled from 8): the self-check
    must see it and exact mode must fall back to calls of at most 7 rows without repacking."""
    q5 = tiny_kquant_model(tmp_path, "Q5_K_M")
    assert "Q5_K" in tensor_types(q5).values()
    runtime = open_runtime(q5)
    assert runtime.info.exactness == "capped"
    assert "self-check failed" in runtime.info.exactness_note and "differs" in runtime.info.exactness_note
    assert runtime.info.max_verify_tokens == EXACT_MAX_ROWS


def test_a_stock_build_runs_capped_without_checking(
    open_runtime: OpenRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama_cpp, "build_is_batch_invariant", lambda: False)
    monkeypatch.setattr(llama_cpp, "check_batch_invariance", lambda *a: pytest.fail("checked a stock build"))
    runtime = open_runtime()
    assert (runtime.info.exactness, runtime.info.max_verify_tokens) == ("capped", EXACT_MAX_ROWS)
    assert "lacks the batch-invariant patch" in runtime.info.exactness_note


def test_flash_attention_is_off_on_the_cpu_unless_asked_and_reaches_llama_cpp(
    open_runtime: OpenRuntime,
) -> None:
    """``auto`` leaves it off without GPU layers; the choice is in the build string (a cost table is kept
    per choice) and reaches the context: the two attentions round differently after a few hundred tokens."""
    assert not uses_flash_attention("auto", "batch-invariant", 0)
    assert uses_flash_attention("auto", "off", 1) and uses_flash_attention("on", "batch-invariant", 0)
    assert not uses_flash_attention("on", "capped", 0)  # stock flash attention is not invariant
    default, flash = open_runtime(), open_runtime(flash_attention="on")
    assert default.info.build.endswith("FLASH_ATTN = 0 | ") and flash.info.build.endswith("FLASH_ATTN = 1 | ")
    tokens = check_tokens(default, 300)
    rows = [rt.decode([DecodeChunk(0, tokens, 0, 1)])[0][0] for rt in (default, flash)]
    assert not np.array_equal(rows[0], rows[1])
    np.testing.assert_allclose(rows[0], rows[1], atol=0.05 * float(np.abs(rows[1]).max()))


def test_fast_mode_skips_the_check(open_runtime: OpenRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_cpp, "check_batch_invariance", lambda *a: pytest.fail("checked fast mode"))
    runtime = open_runtime(exact=False)
    assert (runtime.info.exact, runtime.info.exactness) == (False, "off")


def test_result_describes_the_mismatch() -> None:
    bad = InvarianceResult(rows=16, max_abs_diff=0.37, first_mismatch=4)
    assert not bad.ok and "row 4 of a 16-row batch" in bad.describe() and "0.37" in bad.describe()


def decode_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every llama_decode call from now on (the real calls, counted on the way in)."""
    import llama_cpp as lib

    rows: list[int] = []
    real = lib.llama_decode

    def counting(ctx: object, batch: lib.llama_batch) -> int:
        rows.append(int(batch.n_tokens))
        return int(real(ctx, batch))

    monkeypatch.setattr(lib, "llama_decode", counting)
    return rows


def test_capped_call_rows_are_the_calls_decode_makes(
    open_runtime: OpenRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The policy prices a step with ``call_rows``: in capped mode a prompt chunk of 8+ rows runs alone,
    and smaller chunks — a short prompt tail among them — share calls of at most 7 rows, which llama.cpp
    runs as passes of equal rows per KV stream (test_llama_cpp_passes.py)."""
    monkeypatch.setattr(llama_cpp, "build_is_batch_invariant", lambda: False)
    runtime = open_runtime(max_sequences=4, batch_capacity=64)
    assert runtime.call_rows([100, 3, 5, 2]) == [64, 36, 3, 4, 3]  # calls of 64, 36, 3 and 5 + 2 rows
    assert runtime.call_rows([3, 2, 2]) == [6, 1]  # one call: 2 rows of each sequence, then 1 of the first
    prompt = check_tokens(runtime, 100)
    chunks = [
        DecodeChunk(0, prompt, 0, 1),
        DecodeChunk(1, prompt[:3], 0, 3),  # a prompt tail of 3 rows packs with verify rows
        DecodeChunk(2, prompt[:5], 0, 5),
        DecodeChunk(3, prompt[:2], 0, 2),
    ]
    calls = decode_calls(monkeypatch)
    runtime.decode(chunks)
    assert calls == [64, 36, 3, 7]


def test_batch_invariant_call_rows_are_one_call_per_capacity(
    open_runtime: OpenRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = open_runtime(max_sequences=2, batch_capacity=64)
    assert runtime.info.exactness == "batch-invariant"
    assert runtime.call_rows([3, 2]) == [4, 1]  # one call, two passes: equal rows per KV stream
    assert runtime.call_rows([3, 2], [0, 0]) == [5]  # one sequence's pieces
    assert runtime.call_rows([100, 3]) == [64, 6, 33]  # calls of 64 and 36 + 3 rows
    assert runtime.call_rows([]) == []
    single = open_runtime(max_sequences=1, batch_capacity=64)
    assert single.call_rows([3, 2]) == [5]  # one KV stream: one pass per call
    prompt = check_tokens(runtime, 100)
    calls = decode_calls(monkeypatch)
    runtime.decode([DecodeChunk(0, prompt, 0, 1), DecodeChunk(1, prompt[:3], 0, 3)])
    assert calls == [64, 39]
