"""The DFlash2 block drafter's network (and DFlash's, without selector and convolutions), batched over
sequences.

One forward drafts a whole block: the rows ``[anchor, MASK × (B − 1)]`` of every drafting sequence attend,
without a causal mask, to each other and to their sequence's *context*: the target's hidden states at
``target_layer_ids`` for every committed token, concatenated, projected by ``fc`` and normed, then by each
layer's own k/v projections. Those context keys and values are computed once per committed token and kept
in the drafter's own KV cache (:meth:`BlockDrafterNet.write_context`); the block's own keys live only for
the forward, so after a round the cache holds context only. The drafter has no embedding and no LM head of
its own: it reads the target's.

DFlash2 adds, per layer, a *two-tap dynamic convolution* around attention and around the MLP: along the
block (causal, zero before its first position, so it never reaches across a block boundary), each position
mixes itself and its predecessor with a static kernel plus one predicted from its own hidden state, per
channel group. And a *candidate selector*: per block position the top-K tokens of the block's logits, scored
by their logit plus a low-rank pairwise term between the previous chosen token and each candidate; the walk
from the anchor takes the best candidate (greedy) or samples one from the softmax of the scores, whose
distribution over the K candidates is the draft's ``q`` for lossless rejection sampling.

Parameter names are the published checkpoint's (``state_dict`` loads as it is, the selector codebooks under
their published names without ``.weight``: :func:`published_name`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specserve.backends.torch.kv_cache import KVCache
from specserve.backends.torch.model import RMSNorm
from specserve.backends.torch.transfer import upload_array
from specserve.models.block_drafter import BlockDrafterConfig

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
"""Selector tensors the published checkpoints store without the ``.weight`` of an ``nn.Embedding``."""


def published_name(name: str) -> str:
    """``state_dict`` name → checkpoint name (``…_codebook.weight`` → ``…_codebook``)."""
    return name.removesuffix(".weight") if name.removesuffix(".weight") in CODEBOOKS else name


def module_name(name: str) -> str:
    """Checkpoint name → ``state_dict`` name (the inverse of :func:`published_name`)."""
    return f"{name}.weight" if name in CODEBOOKS else name


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of ``x [..., heads, head_dim]`` with ``cos, sin [..., 1, head_dim]``."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class DynamicConv(nn.Module):
    """The grouped two-tap dynamic causal convolution along a block: ``prepare`` before a sublayer (its
    first kernel, and the dynamic taps of the second), ``finish`` after it."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:  # x [S, B, hidden]
        taps = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self.convolve(x, taps[..., 0, :, :], self.base_kernel[0]), taps[..., 1, :, :]

    def finish(self, x: Tensor, taps: Tensor) -> Tensor:
        return self.convolve(x, taps, self.base_kernel[1])

    def convolve(
        self,
        x: Tensor,  # [S, B, hidden]
        taps: Tensor,  # [S, B, kernel, groups]: each position's predicted kernel, one value per group
        base: Tensor,  # [kernel, hidden]: the static kernel, per channel
    ) -> Tensor:  # [S, B, hidden]
        """``out[t] = Σ_o (base[o] + taps[t, o]) · x[t − o]``, with ``x`` zero before the block's start."""
        s, b, hidden = x.shape
        grouped = x.view(s, b, self.groups, self.group_size)
        out = torch.zeros_like(grouped)
        for offset in range(self.kernel_size):
            shifted = grouped if offset == 0 else F.pad(grouped[:, :-offset], (0, 0, 0, 0, offset, 0))
            kernel = base[offset].view(1, 1, self.groups, self.group_size).to(x.dtype)
            out = out + kernel * shifted + taps[:, :, offset, :, None] * shifted
        return out.view(s, b, hidden)


class Attention(nn.Module):
    def __init__(self, c: BlockDrafterConfig) -> None:
        super().__init__()
        self.c = c
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, q, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, kv, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, kv, bias=c.attention_bias)
        self.o_proj = nn.Linear(q, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rows ``x [..., hidden]`` → their rotated, normed keys and values ``[..., kv_heads, head_dim]``."""
        shape = (*x.shape[:-1], self.c.num_kv_heads, self.c.head_dim)
        k = rotate(self.k_norm(self.k_proj(x).view(shape)), cos, sin)
        return k, self.v_proj(x).view(shape)

    def forward(
        self,
        x: Tensor,  # [S, B, hidden]: the block rows
        rope: tuple[Tensor, Tensor],  # cos, sin [S, B, 1, head_dim] at the block's positions
        context: tuple[Tensor, Tensor],  # cached context keys, values [S, L, kv_heads, head_dim]
        visible: Tensor,  # [S, 1, B, L + B] bool: a sequence's own context and its whole block
    ) -> Tensor:
        c = self.c
        s, b, _ = x.shape
        q = rotate(self.q_norm(self.q_proj(x).view(s, b, c.num_heads, c.head_dim)), *rope)
        k_block, v_block = self.keys_values(x, *rope)
        k = torch.cat([context[0], k_block], dim=1)
        v = torch.cat([context[1], v_block], dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible, enable_gqa=True
        )  # [S, heads, B, head_dim]
        attended: Tensor = self.o_proj(out.transpose(1, 2).reshape(s, b, -1))
        return attended


class MLP(nn.Module):
    def __init__(self, c: BlockDrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Layer(nn.Module):
    def __init__(self, c: BlockDrafterConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        convs = c.version == 2
        self.attention_conv = (
            DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size) if convs else None
        )
        self.mlp_conv = DynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size) if convs else None

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], context: tuple[Tensor, Tensor], visible: Tensor
    ) -> Tensor:
        h = self.input_layernorm(x)
        if self.attention_conv is not None:
            h, taps = self.attention_conv.prepare(h)
        h = self.self_attn(h, rope, context, visible)
        if self.attention_conv is not None:
            h = self.attention_conv.finish(h, taps)
        x = x + h
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h, taps = self.mlp_conv.prepare(h)
        h = self.mlp(h)
        if self.mlp_conv is not None:
            h = self.mlp_conv.finish(h, taps)
        out: Tensor = x + h
        return out


class CandidateSelector(nn.Module):
    def __init__(self, c: BlockDrafterConfig) -> None:
        super().__init__()
        self.top_k = c.selector_top_k
        self.predecessor_codebook = nn.Embedding(c.vocab_size, c.selector_rank)
        self.successor_codebook = nn.Embedding(c.vocab_size, c.selector_rank)
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)

    def scores(
        self,
        projected: Tensor,  # [S, rank]: one block position's hidden_projection
        unary: Tensor,  # [S, K]: its candidates' logits
        candidates: Tensor,  # [S, K] int64
        predecessor: Tensor,  # [S] int64: the token chosen before this position
    ) -> Tensor:  # [S, K] float32
        """A candidate's logit plus the pairwise term between the previous chosen token and it."""
        query = self.predecessor_codebook(predecessor) * projected  # [S, rank]
        pairwise = torch.einsum("sr,skr->sk", query, self.successor_codebook(candidates))
        return (unary + pairwise).float()


class BlockDrafterNet(nn.Module):
    """fc + hidden_norm over the context features, the decoder layers, the final norm (and the selector)."""

    def __init__(self, config: BlockDrafterConfig) -> None:
        super().__init__()
        c = self.config = config
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.decoder_layers: list[Layer] = list(self.layers)  # type: ignore[arg-type] # typed view
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.candidate_selector = CandidateSelector(c) if c.version == 2 else None
        self.inv_freq: Tensor
        exponents = torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim
        self.register_buffer("inv_freq", 1.0 / (c.rope_theta**exponents), persistent=False)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin ``[*positions.shape, 1, head_dim]``: computed in float32, used in the model dtype."""
        angles = positions.float()[..., None] * self.inv_freq  # a buffer: on the module's device
        angles = torch.cat([angles, angles], dim=-1)[..., None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def write_context(self, cache: KVCache, slot: int, start: int, features: Tensor) -> None:
        """Project the target features of tokens ``start …`` (``[n, layers × hidden]``) into ``slot``'s keys
        and values of every drafter layer; the slot then holds ``start + n`` context positions."""
        n = features.shape[0]
        context = self.hidden_norm(self.fc(features))
        positions = torch.arange(start, start + n, device=features.device)
        cos, sin = self.rope(positions, context.dtype)
        for index, layer in enumerate(self.decoder_layers):
            k, v = layer.self_attn.keys_values(context, cos, sin)
            cache.k[index][slot, start : start + n] = k
            cache.v[index][slot, start : start + n] = v
        if slot < cache.num_slots:  # not the scratch slot
            cache.wrote(slot, start + n)

    def forward(
        self,
        embeddings: Tensor,  # [S, B, hidden]: the target's embeddings of [anchor, MASK, …]
        cache: KVCache,
        slots: list[int],
        spans: list[tuple[int, int]],  # sequence s attends to its cached context positions [first, end)
        anchors: list[int],  # the position of each sequence's anchor (its block follows it)
    ) -> Tensor:  # [S, B, hidden], final-normed
        s, b, _ = embeddings.shape
        device = embeddings.device
        longest = max(1, max(end for _, end in spans))
        # One non-blocking copy: [first, end, slot, anchor] per sequence.
        host = [(*span, slot, anchor) for span, slot, anchor in zip(spans, slots, anchors, strict=True)]
        rows = upload_array(np.array(host, np.int64).reshape(s, 4), device)
        firsts, ends, slot_index = rows[:, 0], rows[:, 1], rows[:, 2]
        keys = torch.arange(longest, device=device)
        positions = rows[:, 3, None] + torch.arange(b, device=device)[None, :]
        rope = self.rope(positions, embeddings.dtype)
        in_context = (keys[None, :] >= firsts[:, None]) & (keys[None, :] < ends[:, None])  # [S, L]
        block = torch.ones(s, b, dtype=torch.bool, device=device)
        visible = torch.cat([in_context, block], dim=1)[:, None, None, :].expand(s, 1, b, longest + b)
        x = embeddings
        for index, layer in enumerate(self.decoder_layers):
            context = (cache.k[index][slot_index, :longest], cache.v[index][slot_index, :longest])
            x = layer(x, rope, context, visible)
        out: Tensor = self.norm(x)
        return out

    def logits(self, hidden: Tensor, head: nn.Module) -> Tensor:
        """The target's LM head over drafter states, scaled and soft-capped as the checkpoint says."""
        c = self.config
        logits: Tensor = head(hidden).float() * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits


class TargetFeatures:
    """The target layers a drafter reads, and a pass's captured rows → context features.

    The runtime captures layer outputs in layer order (``capture``); a checkpoint names them in its own
    order. The target's last layer is read after the final norm, as Hugging Face's ``hidden_states`` give
    it (what the published drafters were trained on).
    """

    def __init__(self, target: nn.Module, layer_ids: tuple[int, ...]) -> None:
        self.capture = tuple(sorted(set(layer_ids)))
        self._order = [self.capture.index(i) for i in layer_ids]
        last = len(target.layers) - 1  # type: ignore[arg-type]
        self._normed = layer_ids.index(last) if last in layer_ids else None
        self._norm: nn.Module = target.norm  # type: ignore[assignment]

    @torch.no_grad()
    def __call__(self, rows: Tensor) -> Tensor:  # [n, captured layers, hidden] → [n, layer_ids × hidden]
        picked = rows[:, self._order]
        if self._normed is not None:
            picked = picked.clone()
            picked[:, self._normed] = self._norm(picked[:, self._normed])
        return picked.flatten(1).clone()
