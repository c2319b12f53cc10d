"""The row attention's Triton kernels against a float64 oracle, in Triton's interpreter on this CPU.

The head layouts are the real models' (Qwen2.5-1.5B 12/2 x 128, Qwen2.5-0.5B 14/2 x 64, Llama-3.1-8B 32/8 x
128, Qwen3-8B 32/8 x 128 shares it) at small cache sizes; rows sit on both sides of split boundaries, in
other slots, and in the scratch slot as a padded graph row does. Batch invariance is bit for bit: a row
alone, in a batch, and at another index of a reordered batch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

import torch

from specserve.backends.base import ModelLoadError
from specserve.backends.torch.config import DecoderConfig
from specserve.backends.torch.row_attention import (
    RowAttention,
    choose_row_attention,
    reference,
    split_keys_for,
)

LAYOUTS = [(12, 2, 128), (14, 2, 64), (32, 8, 128), (4, 2, 16)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _case(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, positions: int, seed: int
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    slots = 3
    k = torch.randn(slots + 1, positions, kv_heads, head_dim, generator=generator).to(dtype)
    v = torch.randn(slots + 1, positions, kv_heads, head_dim, generator=generator).to(dtype)
    last = positions - 1
    row_slots = torch.tensor([0, 0, 0, 1, 2, 3, 1])
    row_positions = torch.tensor([0, 255, 256, 257, last, 0, 40])  # split boundaries at 256
    q = torch.randn(len(row_slots), heads, head_dim, generator=generator).to(dtype)
    return q, k, v, row_slots, row_positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{h}-{kv}x{d}" for h, kv, d in LAYOUTS])
def test_the_kernel_matches_float64_attention(layout: tuple[int, int, int], dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim = layout
    positions = 600
    q, k, v, slots, row_positions = _case(heads, kv_heads, head_dim, dtype, positions, seed=sum(layout))
    attention = RowAttention(heads, kv_heads, head_dim, positions)
    assert attention.max_splits == 3
    out = attention(q, k, v, slots, row_positions)
    expected = reference(q.double(), k.double(), v.double(), slots, row_positions)
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()
    error = ((out.double() - expected).norm() / expected.norm()).item()
    assert error < TOLERANCE[dtype], error
    # Row 0 sees one key: its output is that key's value, exactly in float32.
    if dtype == torch.float32:
        group = heads // kv_heads
        torch.testing.assert_close(out[0], v[0, 0].repeat_interleave(group, dim=0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_row_gets_the_same_bits_whatever_shares_its_call(dtype: torch.dtype) -> None:
    q, k, v, slots, row_positions = _case(12, 2, 128, dtype, 600, seed=7)
    attention = RowAttention(12, 2, 128, 600)
    together = attention(q, k, v, slots, row_positions)
    alone = torch.cat(
        [attention(q[i : i + 1], k, v, slots[i : i + 1], row_positions[i : i + 1]) for i in range(7)]
    )
    order = torch.tensor([6, 3, 0, 5, 1, 4, 2])
    shuffled = attention(q[order], k, v, slots[order], row_positions[order])
    assert torch.equal(together, alone)
    assert torch.equal(shuffled, together[order])


def test_a_long_context_spreads_over_many_splits() -> None:
    positions = 4096
    attention = RowAttention(4, 2, 16, positions)
    assert (attention.split_keys, attention.max_splits) == (256, 16)
    q, k, v, _, _ = _case(4, 2, 16, torch.float32, positions, seed=3)
    slots, row_positions = torch.tensor([1, 2]), torch.tensor([4095, 1000])
    out = attention(q[:2], k, v, slots, row_positions)
    expected = reference(q[:2].double(), k.double(), v.double(), slots, row_positions)
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-5


def test_split_sizes_depend_on_the_cache_alone() -> None:
    assert split_keys_for(600) == 256 and split_keys_for(4096) == 256
    assert split_keys_for(32768) == 512 and split_keys_for(100_000) == 1600
    assert "256 keys per split" in RowAttention(4, 2, 16, 600).describe()


def _config(head_dim: int) -> DecoderConfig:
    return DecoderConfig(
        family="qwen2", vocab_size=64, hidden_size=4 * head_dim, intermediate_size=64, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position=256, tie_word_embeddings=False, attention_bias=False, qk_norm=False,
    )  # fmt: skip


def test_the_choice_is_refused_or_falls_back_where_the_kernel_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cpu = torch.device("cpu")
    assert choose_row_attention("auto", _config(16), cpu, 256) is None  # a CPU: the masked SDPA
    assert choose_row_attention("rows", _config(16), cpu, 256) is not None  # interpreted here
    with pytest.raises(ModelLoadError, match="power-of-two head_dim"):
        choose_row_attention("rows", _config(24), cpu, 256)
    with pytest.raises(ModelLoadError, match="one of auto, rows, masked"):
        choose_row_attention("flash", _config(16), cpu, 256)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ModelLoadError, match="run on CUDA"):
        choose_row_attention("rows", _config(16), cpu, 256)
