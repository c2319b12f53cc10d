"""The torch runtime's contract with the engine: KV bookkeeping, batching, exactness, errors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specserve.backends.base import DecodeChunk, DecodeError  # noqa: E402
from specserve.backends.torch.runtime import TorchRuntime  # noqa: E402
from support.tiny_models import TinyModels  # noqa: E402

TEXT = "def check(values):\n    return [value * 2 for value in values if value]\n" * 4


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def runtime(tiny_models: TinyModels, request: pytest.FixtureRequest) -> TorchRuntime:
    """Exact mode in both CPU dtypes (``auto`` picks bf16 where the CPU has bf16 instructions)."""
    return TorchRuntime(
        tiny_models.target, context_per_sequence=256, max_sequences=3, n_threads=1, dtype=request.param
    )


def test_exact_mode_is_proved_at_load(runtime: TorchRuntime) -> None:
    info = runtime.info
    assert info.exact and info.exactness == "batch-invariant", info.exactness_note
    assert "bit for bit" in info.exactness_note
    assert info.logits_device == "torch:cpu" and info.vocab_size == runtime.config.vocab_size


@pytest.mark.parametrize("context", [30, 60, 124])
def test_a_row_is_the_same_bits_alone_in_a_verify_chunk_and_beside_other_sequences(
    runtime: TorchRuntime, context: int
) -> None:
    """Verify rows at positions 30-36, and across the key-length buckets at 64 and 128."""
    ids = (runtime.tokenize(TEXT) * 2)[: context + 7]
    for slot in range(3):
        runtime.free(slot)
    runtime.decode([DecodeChunk(0, ids[:context], 0, 0)])
    verify = runtime.decode([DecodeChunk(0, ids[context:], context, 7)])[0].clone()
    runtime.truncate(0, context)
    alone = [
        runtime.decode([DecodeChunk(0, [t], context + i, 1)])[0][0].clone()
        for i, t in enumerate(ids[context:])
    ]
    runtime.truncate(0, context)
    crowded = runtime.decode(
        [
            DecodeChunk(1, ids[:50], 0, 1),
            DecodeChunk(0, ids[context:], context, 7),
            DecodeChunk(2, ids[5:9], 0, 4),
        ]
    )[1]
    for i in range(7):
        assert torch.equal(verify[i], alone[i]) and torch.equal(verify[i], crowded[i])


def test_kv_truncate_copy_save_load(runtime: TorchRuntime) -> None:
    ids = runtime.tokenize(TEXT)[:40]
    for slot in range(3):
        runtime.free(slot)
    runtime.decode([DecodeChunk(0, ids[:30], 0, 0)])
    assert runtime.kv_positions(0) == 30
    runtime.truncate(0, 20)
    assert runtime.kv_positions(0) == 20
    reference = runtime.decode([DecodeChunk(0, ids[20:25], 20, 5)])[0].clone()

    assert runtime.copy_sequence(0, 1, 20) and runtime.kv_positions(1) == 20
    assert torch.equal(runtime.decode([DecodeChunk(1, ids[20:25], 20, 5)])[0], reference)

    blob = runtime.save_sequence(0)
    assert blob is not None
    kv_bytes = 25 * runtime.info.kv_bytes_per_token
    assert kv_bytes <= len(blob) < kv_bytes + 4096  # the slot's KV, not the whole cache
    runtime.free(2)
    assert runtime.load_sequence(2, blob) == 25
    runtime.truncate(2, 20)
    assert torch.equal(runtime.decode([DecodeChunk(2, ids[20:25], 20, 5)])[0], reference)
    assert runtime.load_sequence(2, b"not a blob") == 0


def test_bad_calls_raise_decode_errors(runtime: TorchRuntime) -> None:
    for slot in range(3):
        runtime.free(slot)
    with pytest.raises(DecodeError, match="full"):
        runtime.decode([DecodeChunk(0, [1] * 10, 250, 1)])
    with pytest.raises(DecodeError, match="gap"):
        runtime.decode([DecodeChunk(0, [1], 5, 1)])
    with pytest.raises(DecodeError, match="slot"):
        runtime.decode([DecodeChunk(7, [1], 0, 1)])
    with pytest.raises(DecodeError, match="token id"):
        runtime.decode([DecodeChunk(0, [1, runtime.info.vocab_size], 0, 1)])
    runtime.decode([DecodeChunk(0, [1, 2, 3], 0, 1)])
    with pytest.raises(DecodeError, match="overwrite"):
        runtime.decode([DecodeChunk(0, [1], 1, 1)])
    runtime.free(0)
    assert runtime.kv_positions(0) == 0
    assert len(runtime.decode([])) == 0  # an empty step evaluates nothing


def test_long_chunks_run_in_pieces_beside_short_ones(tiny_models: TinyModels) -> None:
    """A chunk longer than one pass (a long prompt, a draft model's catch-up) runs in pieces of its own,
    the short chunks together: the same logits as each chunk alone, and call_rows says so."""
    runtime = TorchRuntime(
        tiny_models.target, context_per_sequence=1200, max_sequences=2, n_threads=1, dtype="float32"
    )
    try:
        ids = (runtime.tokenize(TEXT) * 20)[:700]
        assert runtime.call_rows([3, 700]) == [3, 512, 188]
        both = runtime.decode([DecodeChunk(0, ids[:3], 0, 3), DecodeChunk(1, ids, 0, 2)])
        assert both.offsets == (0, 3, 5)
        runtime.free(0)
        runtime.free(1)
        alone = runtime.decode([DecodeChunk(1, ids, 0, 2)])[0]
        short = runtime.decode([DecodeChunk(0, ids[:3], 0, 3)])[0]
        assert (both[1] - alone).abs().max().item() < 1e-4
        assert (both[0] - short).abs().max().item() < 1e-4
    finally:
        runtime.close()


def test_a_failed_self_check_turns_exact_mode_off_and_says_why(
    tiny_models: TinyModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    from specserve.backends import invariance
    from specserve.backends.torch import runtime as runtime_module

    failed = invariance.InvarianceResult(rows=16, max_abs_diff=1e-6, first_mismatch=4)
    monkeypatch.setattr(runtime_module, "check_batch_invariance", lambda _runtime: failed)
    runtime = TorchRuntime(tiny_models.target, context_per_sequence=64, n_threads=1)
    try:
        assert runtime.info.exactness == "off" and not runtime.info.exact
        assert "self-check failed: row 4" in runtime.info.exactness_note
        assert not runtime.kernels.invariant
    finally:
        runtime.close()
    assert runtime.kv_positions(0) == 0  # a closed runtime's bookkeeping still answers


def test_closed_runtime_refuses_to_decode(tiny_models: TinyModels) -> None:
    runtime = TorchRuntime(tiny_models.draft, context_per_sequence=64, n_threads=1, exact=False)
    assert runtime.info.exactness == "off" and not runtime.info.exact
    runtime.close()
    with pytest.raises(DecodeError, match="closed"):
        runtime.decode([DecodeChunk(0, [1], 0, 1)])


def _fast(tiny_models: TinyModels, attention: str = "masked", exact: bool = False) -> TorchRuntime:
    return TorchRuntime(
        tiny_models.target,
        context_per_sequence=300,
        max_sequences=3,
        n_threads=1,
        exact=exact,
        dtype="float32",
        attention=attention,
    )


STEPS = [
    [(0, 0, 20, 1)],  # (slot, start, rows, logits): a prompt from position 0
    [(0, 20, 5, 5), (1, 0, 3, 3)],
    [(0, 25, 1, 1), (1, 3, 7, 7), (2, 0, 9, 2)],
    [(2, 9, 200, 1)],  # a long chunk continuing a prefix: past the split at 256 keys
]


def _chunks(ids: list[int], step: list[tuple[int, int, int, int]]) -> list[DecodeChunk]:
    return [DecodeChunk(slot, ids[start : start + n], start, logits) for slot, start, n, logits in step]


def test_the_row_attention_gives_the_masked_attentions_logits(tiny_models: TinyModels) -> None:
    """The Triton kernel (interpreted here) over the cache in place against SDPA over gathered keys: prompt
    chunks, verify chunks of several sequences, a long chunk after a prefix; fast kernels and exact mode."""
    masked, rows = _fast(tiny_models), _fast(tiny_models, "rows")
    ids = masked.tokenize(TEXT * 3)
    try:
        for step in STEPS:
            a, b = masked.decode(_chunks(ids, step)), rows.decode(_chunks(ids, step))
            assert a.offsets == b.offsets and (a.rows - b.rows).abs().max().item() < 1e-4
        assert rows.kernels.used == {"rows", "sdpa-causal"} and masked.kernels.used == {"sdpa-masked"}
        assert rows.attention_kernel.startswith("triton rows") and "triton rows" in rows.info.build
    finally:
        masked.close()
        rows.close()
    exact = _fast(tiny_models, "rows", exact=True)
    try:
        assert exact.info.exactness == "batch-invariant", exact.info.exactness_note
        assert exact.kernels.used == {"rows"}  # every row, prompts too: their K and V feed later layers
    finally:
        exact.close()


def test_cuda_graph_layout_gives_the_eager_logits(tiny_models: TinyModels) -> None:
    """The graphs' padded row buckets (padding rows in the scratch slot) run here without capture: the
    eager logits, for one sequence and for mixed batches, and a bucket replayed with new content."""
    from specserve.backends.torch.graphs import GraphRunner, row_buckets

    assert row_buckets(40, None) == [1, 2, 4, 8, 16, 24, 32, 48] and row_buckets(40, 32) == [32, 64]
    assert row_buckets(3, None) == [1, 2, 4] and row_buckets(200, None)[-3:] == [128, 192, 256]
    eager, padded = _fast(tiny_models, "rows"), _fast(tiny_models, "rows")
    padded.graphs = GraphRunner(padded.model, padded.cache, padded.kernels, max_rows=24, capture=False)
    ids = eager.tokenize(TEXT * 3)
    try:
        for step in STEPS[:3]:
            a, b = eager.decode(_chunks(ids, step)), padded.decode(_chunks(ids, step))
            assert a.offsets == b.offsets
            assert (a.rows - b.rows).abs().max().item() < 1e-5
        assert sorted(padded.graphs.graphs) == [(8, ()), (24, ())]  # 20 and 17 rows share 24
        assert padded.kv_positions(1) == 10 and padded.kv_positions(2) == 9
        # Warming: every bucket, largest first, writing only the scratch slot.
        assert padded.graphs.warm() == 6
        assert [padded.kv_positions(slot) for slot in range(3)] == [26, 10, 9]
        # A block drafter's layers: graphs of their own, the eager hidden states.
        eager.capture_layers = padded.capture_layers = (0, 1)
        assert len(padded.graphs.graphs) == 12
        chunks = [DecodeChunk(0, ids[26:30], 26, 4), DecodeChunk(1, ids[10:12], 10, 2)]
        a, b = eager.decode(chunks), padded.decode(chunks)
        assert eager.hidden is not None and padded.hidden is not None
        assert padded.hidden.rows.shape == eager.hidden.rows.shape == (6, 2, eager.config.hidden_size)
        assert (eager.hidden.rows - padded.hidden.rows).abs().max().item() < 1e-5
        assert (a.rows - b.rows).abs().max().item() < 1e-5
    finally:
        eager.close()
        padded.close()
