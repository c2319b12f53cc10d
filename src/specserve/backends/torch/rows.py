"""A decoder layer's row-wise work as free functions of tensors: what ``--compile`` fuses.

Eager, RMSNorm alone is five kernels (square, mean, rsqrt, two multiplies) and the MLP's SiLU·mul three
more around its two products, each a read and a write of every row; RoPE is six more per tensor (chunk,
negate, cat, two multiplies, add) before the two scattered cache writes. ``torch.compile`` (Inductor) fuses
each norm into one kernel, the activation into the product's epilogue, and RoPE of q and k with the writes
of k and v into the cache (the cache is mutated in place: Inductor's scatter, no copy of the cache).
The functions take the weights (and the layer's caches) as arguments rather than being module methods so
that one compiled graph serves every layer: Dynamo keys its cache by code object and guards on the inputs'
shapes and dtypes, which every layer shares (a method per layer would compile once per layer and hit the
recompilation limit).

Exact mode calls the norms and products on tiles of exactly ``tile_rows`` rows (model.py's
``Kernels.rows``), so their compiled graph has one static shape and every row runs the same generated
kernel whatever its batch: fused and still batch-invariant, which the runtime's self-check proves at load
as for the eager kernels. RoPE and the cache writes are elementwise, the same bits at any row count (tested
against eager). Fast mode calls the functions on every row count: Dynamo's automatic dynamic shapes
compile one graph symbolic in the rows after the second size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """In float32 whatever the model dtype, as the reference implementations do."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def qkv_rows(x: Tensor, norm: Tensor, eps: float, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Rows ``[n, hidden]`` → their fused q, k and v ``[n, q + 2 kv]`` (input norm, then one product)."""
    return F.linear(rms_norm(x, norm, eps), weight, bias)


def mlp_rows(x: Tensor, norm: Tensor, eps: float, gate_up: Tensor, down: Tensor) -> Tensor:
    """Rows ``[n, hidden]`` → the MLP's output ``[n, hidden]`` (post-attention norm, SwiGLU)."""
    gate, up = F.linear(rms_norm(x, norm, eps), gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE: ``x [N, heads, head_dim]``, ``cos, sin [N, 1, head_dim]`` at each row's position."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


def rope_write(
    q: Tensor,  # [N, heads, head_dim]
    k: Tensor,  # [N, kv_heads, head_dim]
    v: Tensor,  # [N, kv_heads, head_dim]
    cos: Tensor,  # [N, 1, head_dim] at each row's position
    sin: Tensor,
    cache_k: Tensor,  # [slots, positions, kv_heads, head_dim], written in place
    cache_v: Tensor,
    slots: Tensor,  # [N] int64
    positions: Tensor,  # [N] int64
) -> Tensor:  # [N, heads, head_dim]: q rotated
    """RoPE on q and k, and k and v written to the cache at each row's (slot, position)."""
    cache_k[slots, positions] = rotate(k, cos, sin)
    cache_v[slots, positions] = v
    return rotate(q, cos, sin)


class RowFunctions:
    """The row functions a runtime's layers call (``Kernels.row_functions``): eager, or compiled once for
    all of its layers."""

    def __init__(self) -> None:
        self.qkv: Callable[..., Tensor] = qkv_rows
        self.mlp: Callable[..., Tensor] = mlp_rows
        self.rope_write: Callable[..., Tensor] = rope_write
        self.compiled = False

    def compile(self) -> None:
        """Compile lazily: Inductor generates the kernels at each function's first call (the runtime makes
        those calls at load)."""
        self.qkv = torch.compile(qkv_rows, fullgraph=True)
        self.mlp = torch.compile(mlp_rows, fullgraph=True)
        self.rope_write = torch.compile(rope_write, fullgraph=True)
        self.compiled = True
