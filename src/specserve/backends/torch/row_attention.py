"""Attention of token rows over the KV cache in place: each row reads its own slot's keys up to its own
position, with no gathered copy, no dense mask and no expanded K/V.

Why: the masked SDPA over gathered keys (``model.Kernels``, the CPU's path) cannot reach FlashAttention on
a GPU (it refuses a mask), the memory-efficient kernel refuses grouped-query heads, and cuDNN builds a new
plan per key length, while every decode step has a new key length. Here a row carries its own length in a
device tensor, so one launch serves any mix of decode and verify rows at any lengths, and a CUDA graph
captured once serves every key length up to the cache's (no key-length buckets).

Split-K (``row_attention_kernels``): a row's keys are cut into splits of :attr:`RowAttention.split_keys`,
fixed when the runtime loads from the cache size alone, and merged in split order, so one row's result
never depends on which rows share the call (exact mode's batch invariance) while a long context still
spreads over many programs. :func:`reference` is the same function in plain torch (float32): the
kernel's test oracle, and what the rows layout runs where Triton cannot (a CPU without the interpreter).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
from torch import Tensor

from specserve.backends.base import ModelLoadError

log = logging.getLogger("specserve.torch")

BLOCK_N = 64
"""Keys per inner iteration of the split kernel (a multiple of 16 for the matrix units)."""
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 64


def triton_unavailable(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on ``device``, or None when it can (CUDA with Triton installed; on
    a CPU only under ``TRITON_INTERPRET=1``, the tests' way of checking its numbers without a GPU)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"Triton kernels run on CUDA (or interpreted with TRITON_INTERPRET=1), not on {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def split_keys_for(positions: int) -> int:
    """The split size for a cache of ``positions`` per slot: at least 256 keys, at most 64 splits.

    Example: 4,096 positions → 256 (16 splits); 32,768 → 512 (64 splits).
    """
    size = max(MIN_SPLIT_KEYS, math.ceil(positions / MAX_SPLITS))
    return BLOCK_N * math.ceil(size / BLOCK_N)


class RowAttention:
    """The kernel pair for one cache layout: ``num_heads`` query heads over ``num_kv_heads``, ``head_dim``
    wide, ``positions`` per slot."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, positions: int) -> None:
        if num_heads % num_kv_heads or head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(
                f"row attention needs heads a multiple of kv heads and a power-of-two head_dim >= 16, "
                f"not {num_heads}/{num_kv_heads} x {head_dim}"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.split_keys = split_keys_for(positions)
        self.max_splits = math.ceil(positions / self.split_keys)
        self.scale_log2 = head_dim**-0.5 * math.log2(math.e)

    def describe(self) -> str:
        return f"triton rows (split-K, {self.split_keys} keys per split, up to {self.max_splits} splits)"

    def __call__(
        self,
        q: Tensor,  # [rows, heads, head_dim]
        k: Tensor,  # [slots, positions, kv_heads, head_dim] (one layer)
        v: Tensor,  # [slots, positions, kv_heads, head_dim]
        slots: Tensor,  # [rows] int64
        positions: Tensor,  # [rows] int64
    ) -> Tensor:  # [rows, heads, head_dim], q's dtype
        from specserve.backends.torch import row_attention_kernels as kernels

        rows = q.shape[0]
        out = torch.empty_like(q)
        if rows == 0:
            return out
        q = q.contiguous()
        shape = (rows, self.num_heads, self.max_splits)
        acc = torch.empty((*shape, self.head_dim), dtype=torch.float32, device=q.device)
        split_max = torch.empty(shape, dtype=torch.float32, device=q.device)
        split_sum = torch.empty(shape, dtype=torch.float32, device=q.device)
        precision = "ieee" if q.dtype == torch.float32 else None  # 16-bit inputs: the default
        launch: Any = kernels.split_kernel[(rows, self.num_kv_heads, self.max_splits)]
        launch(
            q, k, v, slots, positions, acc, split_max, split_sum,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), self.scale_log2,
            NUM_HEADS=self.num_heads, GROUP=self.group, BLOCK_G=max(16, _next_power_of_two(self.group)),
            HEAD_DIM=self.head_dim, BLOCK_N=BLOCK_N, SPLIT_KEYS=self.split_keys,
            MAX_SPLITS=self.max_splits, PRECISION=precision, WIDEN=q.device.type == "cpu",
        )  # fmt: skip
        merge: Any = kernels.merge_kernel[(rows, self.num_heads)]
        merge(
            out, positions, acc, split_max, split_sum, out.stride(0), out.stride(1),
            NUM_HEADS=self.num_heads, HEAD_DIM=self.head_dim, SPLIT_KEYS=self.split_keys,
            MAX_SPLITS=self.max_splits,
        )  # fmt: skip
        return out


def reference(
    q: Tensor,  # [rows, heads, head_dim]
    k: Tensor,  # [slots, positions, kv_heads, head_dim]
    v: Tensor,  # [slots, positions, kv_heads, head_dim]
    slots: Tensor,  # [rows] int64
    positions: Tensor,  # [rows] int64
) -> Tensor:  # [rows, heads, head_dim], q's dtype
    """Row ``i`` over keys ``0 .. positions[i]`` of slot ``slots[i]``, in float32 (the kernel's oracle)."""
    rows, heads, head_dim = q.shape
    if rows == 0:
        return torch.empty_like(q)
    kv_heads = k.shape[2]
    length = int(positions.max()) + 1
    keys = torch.arange(length, device=q.device)
    k_rows = k[slots[:, None], keys[None, :]].float()  # [rows, length, kv_heads, head_dim]
    v_rows = v[slots[:, None], keys[None, :]].float()
    grouped = q.float().view(rows, kv_heads, heads // kv_heads, head_dim)
    scores = torch.einsum("rkgd,rlkd->rkgl", grouped, k_rows) * head_dim**-0.5
    visible = keys[None, :] <= positions[:, None]  # [rows, length]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("rkgl,rlkd->rkgd", torch.softmax(scores, dim=-1), v_rows)
    return out.reshape(rows, heads, head_dim).to(q.dtype)


def choose_row_attention(
    choice: str, config: Any, device: torch.device, positions: int
) -> RowAttention | None:
    """The row attention for ``choice`` (``auto``, ``rows`` or ``masked``; see ``TorchRuntime``) for a
    decoder of ``config`` (a ``DecoderConfig``), or None for the masked SDPA; ``rows`` where it cannot run
    is a load error, ``auto`` falls back and says why on a GPU."""
    if choice not in ("auto", "rows", "masked"):
        raise ModelLoadError(f"attention {choice!r}: one of auto, rows, masked")
    why_not = triton_unavailable(device)
    if choice == "masked" or (choice == "auto" and (device.type != "cuda" or why_not)):
        if choice == "auto" and device.type == "cuda":
            log.warning("attention over gathered keys with a mask, no CUDA graphs: %s", why_not)
        return None
    if why_not:
        raise ModelLoadError(f"attention 'rows': {why_not}")
    try:
        return RowAttention(config.num_heads, config.num_kv_heads, config.head_dim, positions)
    except ValueError as exc:
        if choice == "rows":
            raise ModelLoadError(str(exc)) from exc
        log.warning("%s: attention over gathered keys with a mask", exc)
        return None


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()
