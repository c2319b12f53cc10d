"""A decoder layer's row-wise work as free functions of tensors: what ``--compile`` fuses.

Eager, RMSNorm alone is five kernels (square, mean, rsqrt, two multiplies) and the MLP's SiLU·mul three
more around its two products, each a read and a write of every row. ``torch.compile`` (Inductor) fuses each
norm into one kernel and the activation into the product's epilogue. The functions take the weights as
arguments rather than being module methods so that one compiled graph serves every layer: Dynamo keys its
cache by code object and guards on the inputs' shapes and dtypes, which every layer shares (a method per
layer would compile once per layer and hit the recompilation limit).

Exact mode calls them on tiles of exactly ``tile_rows`` rows (model.py's ``Kernels.rows``), so the compiled
graph has one static shape and every row runs the same generated kernel whatever its batch: fused and
still batch-invariant, which the runtime's self-check proves at load as for the eager kernels. Fast mode
calls them on every row count: Dynamo's automatic dynamic shapes compile one graph symbolic in the rows
after the second size.
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


class RowFunctions:
    """The row functions a runtime's layers call (``Kernels.row_functions``): eager, or compiled once for
    all of its layers."""

    def __init__(self) -> None:
        self.qkv: Callable[..., Tensor] = qkv_rows
        self.mlp: Callable[..., Tensor] = mlp_rows
        self.compiled = False

    def compile(self) -> None:
        """Compile lazily: Inductor generates the kernels at each function's first call (the runtime makes
        those calls at load)."""
        self.qkv = torch.compile(qkv_rows, fullgraph=True)
        self.mlp = torch.compile(mlp_rows, fullgraph=True)
        self.compiled = True
