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


def test_a_row_is_the_same_bits_alone_in_a_verify_chunk_and_beside_other_sequences(
    runtime: TorchRuntime,
) -> None:
    ids = runtime.tokenize(TEXT)
    for slot in range(3):
        runtime.free(slot)
    runtime.decode([DecodeChunk(0, ids[:30], 0, 0)])
    verify = runtime.decode([DecodeChunk(0, ids[30:37], 30, 7)])[0].clone()
    runtime.truncate(0, 30)
    alone = [runtime.decode([DecodeChunk(0, [t], 30 + i, 1)])[0][0].clone() for i, t in enumerate(ids[30:37])]
    runtime.truncate(0, 30)
    crowded = runtime.decode(
        [DecodeChunk(1, ids[:50], 0, 1), DecodeChunk(0, ids[30:37], 30, 7), DecodeChunk(2, ids[5:9], 0, 4)]
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
    assert runtime.kv_positions(0) == 0  # a refused call writes nothing


def test_closed_runtime_refuses_to_decode(tiny_models: TinyModels) -> None:
    runtime = TorchRuntime(tiny_models.draft, context_per_sequence=64, n_threads=1, exact=False)
    assert runtime.info.exactness == "off" and not runtime.info.exact
    runtime.close()
    with pytest.raises(DecodeError, match="closed"):
        runtime.decode([DecodeChunk(0, [1], 0, 1)])


def test_cuda_graph_layout_gives_the_eager_logits(tiny_models: TinyModels) -> None:
    """The graphs' padded buckets (padding rows and keys in the scratch slot) run here without capture:
    same logits as eager decoding, for one sequence and for a mixed batch."""
    from specserve.backends.torch.graphs import GraphRunner

    eager = TorchRuntime(
        tiny_models.target,
        context_per_sequence=300,
        max_sequences=3,
        n_threads=1,
        exact=False,
        dtype="float32",
    )
    padded = TorchRuntime(
        tiny_models.target,
        context_per_sequence=300,
        max_sequences=3,
        n_threads=1,
        exact=False,
        dtype="float32",
    )
    padded.graphs = GraphRunner(padded.model, padded.cache, padded.kernels, capture=False)
    ids = eager.tokenize(TEXT)
    steps = [
        [DecodeChunk(0, ids[:20], 0, 1)],
        [DecodeChunk(0, ids[20:25], 20, 5), DecodeChunk(1, ids[:3], 0, 3)],
        [DecodeChunk(0, ids[25:26], 25, 1), DecodeChunk(1, ids[3:10], 3, 7), DecodeChunk(2, ids[:9], 0, 2)],
    ]
    try:
        for chunks in steps:
            a, b = eager.decode(chunks), padded.decode(chunks)
            assert a.offsets == b.offsets
            assert (a.rows - b.rows).abs().max().item() < 1e-5
        assert len(padded.graphs.graphs) == 3  # one bucket per step shape
        assert padded.kv_positions(1) == 10 and padded.kv_positions(2) == 9
        # Warming at load: batches 1, 2, 4 (3 slots) x verify chunks 1..8 rows (B x T <= 64), no KV kept.
        for slot in range(3):
            padded.free(slot)
        assert padded.graphs.warm(3, 8) == 3 + 12 - 1  # the (1, 1, 256) bucket existed already
        assert all(padded.kv_positions(slot) == 0 for slot in range(3))
    finally:
        eager.close()
        padded.close()
