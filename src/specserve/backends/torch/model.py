"""The decoder math: Qwen2/Qwen2.5, Qwen3 and Llama 3 as one implementation (no loading, no scheduling).

A forward pass evaluates a flat list of token rows that may belong to many sequences at different
positions (prompt chunks and verify chunks of one engine step together). Each row writes its K and V into
the cache at (its slot, its position) and attends to the keys of its own slot up to its own position; the
:class:`Step` says which keys those are. Only the rows asked for reach the LM head.

Two ways to run the same math (:class:`Kernels`):

* fast: every matrix product over all rows at once, attention as one masked SDPA over the gathered keys of
  every sequence in the step;
* batch-invariant: every row-wise operation runs on tiles of exactly ``tile_rows`` rows, and attention runs
  per row over a key length fixed by that row's own position (a power-of-two bucket), in tiles of the same
  size. Every kernel then sees one shape whatever the batch, so a row's arithmetic cannot depend on how many
  rows share its call or where it sits among them: a token's logits are the same bits in a one-token step
  and in a verify chunk. The self-check in the runtime proves it on the loaded model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specserve.backends.torch.config import DecoderConfig, rope_inverse_frequencies
from specserve.backends.torch.kv_cache import KVCache
from specserve.backends.torch.row_attention import RowAttention
from specserve.backends.torch.rows import RowFunctions, rms_norm

KEY_BUCKET_MIN = 64
"""Smallest key length of the batch-invariant attention (rows at positions < 64 share one shape)."""


@dataclass(frozen=True)
class Step:
    """The device tensors of one forward pass over ``N`` token rows in ``B`` chunks (one per sequence).

    Every layout has the rows' ``token_ids``, ``positions`` and ``slots``: row ``i`` writes its K and V at
    (``slots[i]``, ``positions[i]``) and attends to keys ``0 .. positions[i]`` of that slot, which is all
    the row attention (:mod:`.row_attention`) reads. The masked layout (the CPU's fast kernels) adds: chunk
    ``b``'s queries are rows ``query_index[b]`` (``N`` = a zero padding query); it attends to key ``j``
    (position ``key_positions[b, j]`` of slot ``key_slots[b, j]``) where ``mask[b, t, j]``; row ``i`` reads
    its output back at ``[row_chunk[i], row_pos[i]]``. The CPU's batch-invariant kernels read
    ``key_buckets``.
    """

    token_ids: Tensor  # [N] int64
    positions: Tensor  # [N] int64
    slots: Tensor  # [N] int64, the KV slot each row writes (the scratch slot for padding rows)
    logit_rows: Tensor  # [R] int64, rows whose logits are returned, in order
    query_index: Tensor | None = None  # [B, T] int64 in [0, N]
    row_chunk: Tensor | None = None  # [N] int64
    row_pos: Tensor | None = None  # [N] int64
    key_slots: Tensor | None = None  # [B, L] int64
    key_positions: Tensor | None = None  # [B, L] int64
    mask: Tensor | None = None  # [B, T, L] bool
    key_buckets: tuple[tuple[int, Tensor], ...] = ()
    """Batch-invariant attention: (key length, row indices [n] int64) per group of rows sharing one."""
    only_slot: int | None = None
    """One chunk, eager: its keys are a view of its slot (no gather)."""
    from_start: bool = False
    """With ``only_slot``: the chunk starts at position 0, so its keys are its own rows (causal SDPA)."""


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Kernels:
    """How row-wise work and attention run: over all rows (fast) or in fixed-shape tiles (invariant)."""

    def __init__(
        self,
        tile_rows: int | None,
        attention_rows: int = 4,
        row_attention: RowAttention | None = None,
        row_functions: RowFunctions | None = None,
    ) -> None:
        self.tile_rows = tile_rows
        """None: fast kernels; else the row count of every row-wise kernel call (batch-invariant)."""
        self.attention_rows = attention_rows
        """Query rows of every batch-invariant attention call: few, as each gathers its own keys."""
        self.row_attention = row_attention
        """Attention over the cache in place (a GPU's): every row in both modes, except a prompt chunk
        from position 0 in fast mode, which goes to causal SDPA (FlashAttention's shape)."""
        self.used: set[str] = set()
        """The attention paths that ran (``rows``, ``sdpa-causal``, ``sdpa-masked``, ``tiles``)."""
        self.row_functions = row_functions or RowFunctions()
        """Each layer's row-wise work: eager, or compiled (``--compile``); the runtime's, not the model's,
        as runtimes may share one model (the GPU check's modes)."""

    @property
    def invariant(self) -> bool:
        return self.tile_rows is not None

    def rows(self, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """``fn`` over the rows of ``x [n, d]``: at once, or tile by tile with the last tile zero-padded."""
        if self.tile_rows is None or x.shape[0] == 0:
            return fn(x)
        m = self.tile_rows
        n = x.shape[0]
        padded = F.pad(x, (0, 0, 0, (-n) % m))
        return torch.cat([fn(padded[i : i + m]) for i in range(0, padded.shape[0], m)])[:n]

    def attention(self, q: Tensor, cache: KVCache, layer: int, step: Step) -> Tensor:
        """``q [N, heads, head_dim]`` → ``[N, heads, head_dim]`` over the cached keys the step allows."""
        if self.row_attention is not None:
            if step.from_start and step.only_slot is not None and not self.invariant:
                self.used.add("sdpa-causal")
                n = q.shape[0]
                k, v = cache.k[layer][step.only_slot, :n], cache.v[layer][step.only_slot, :n]
                out = F.scaled_dot_product_attention(
                    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
                )  # [heads, N, head_dim]
                return out.transpose(0, 1)
            self.used.add("rows")
            return self.row_attention(q, cache.k[layer], cache.v[layer], step.slots, step.positions)
        if self.tile_rows is None:
            self.used.add("sdpa-masked")
            assert step.query_index is not None and step.mask is not None, "a masked step"
            assert step.row_chunk is not None and step.row_pos is not None
            if step.only_slot is not None:  # one sequence: its keys as they lie in the cache
                end = step.mask.shape[2]
                k, v = cache.k[layer][step.only_slot, :end][None], cache.v[layer][step.only_slot, :end][None]
            else:
                k = cache.k[layer][step.key_slots, step.key_positions]  # [B, L, kv_heads, head_dim]
                v = cache.v[layer][step.key_slots, step.key_positions]
            queries = F.pad(q, (0, 0, 0, 0, 0, 1))[step.query_index]  # [B, T, heads, head_dim]
            out = F.scaled_dot_product_attention(
                queries.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=step.mask[:, None],
                enable_gqa=True,
            )  # [B, heads, T, head_dim]
            return out.transpose(1, 2)[step.row_chunk, step.row_pos]
        self.used.add("tiles")
        return self._invariant_attention(q, cache, layer, step)

    def _invariant_attention(self, q: Tensor, cache: KVCache, layer: int, step: Step) -> Tensor:
        m = self.attention_rows
        out = torch.empty_like(q)
        for key_len, rows in step.key_buckets:
            keys = torch.arange(key_len, device=q.device)
            for lo in range(0, rows.shape[0], m):
                # Pad the tile with copies of its first row: same shape for every tile, finite values.
                tile = rows[lo : lo + m]
                tile = torch.cat([tile, tile[:1].expand(m - tile.shape[0])])
                slots, positions = step.slots[tile], step.positions[tile]
                k = cache.k[layer][slots[:, None], keys[None, :]]  # [m, key_len, kv_heads, head_dim]
                v = cache.v[layer][slots[:, None], keys[None, :]]
                mask = keys[None, :] <= positions[:, None]  # [m, key_len]
                o = _explicit_attention(q[tile], k, v, mask)
                real = min(m, rows.shape[0] - lo)
                out[tile[:real]] = o[:real]
        return out


def _explicit_attention(
    q: Tensor,  # [m, heads, head_dim]
    k: Tensor,  # [m, key_len, kv_heads, head_dim]
    v: Tensor,  # [m, key_len, kv_heads, head_dim]
    mask: Tensor,  # [m, key_len] bool
) -> Tensor:  # [m, heads, head_dim]
    """Attention of one query row per batch entry, spelled out in two matrix products and a softmax.

    Not SDPA: the CPU's fused kernel vectorizes across batch entries, so a row's result depends on its
    index in the batch (seen on an AVX-512 CPU: the same row at another batch index gives other bits).
    """
    m, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.view(m, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, k.permute(0, 2, 3, 1)) * head_dim**-0.5  # [m, kv_heads, group, key_len]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v.permute(0, 2, 1, 3)).reshape(m, heads, head_dim)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # q, k and v in one matrix (and gate with up): one kernel instead of three per layer.
        self.qkv_proj = nn.Linear(c.hidden_size, q_size + 2 * kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(q_size, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def _qkv(self, x: Tensor, fns: RowFunctions) -> Tensor:
        """Rows → their q, k and v, q and k normalised per head where the family does (Qwen3)."""
        c = self.config
        norm, proj = self.input_layernorm, self.qkv_proj
        qkv = fns.qkv(x, norm.weight, norm.eps, proj.weight, proj.bias)
        if self.q_norm is None or self.k_norm is None:
            return qkv
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, c.num_heads, c.head_dim)).flatten(-2)
        k = self.k_norm(k.reshape(-1, c.num_kv_heads, c.head_dim)).flatten(-2)
        return torch.cat([q, k, v], dim=-1)

    def _mlp(self, x: Tensor, fns: RowFunctions) -> Tensor:
        norm, gate_up, down = self.post_attention_layernorm, self.gate_up_proj, self.down_proj
        return fns.mlp(x, norm.weight, norm.eps, gate_up.weight, down.weight)

    def forward(
        self, x: Tensor, step: Step, rope: tuple[Tensor, Tensor], cache: KVCache, layer: int, kernels: Kernels
    ) -> Tensor:
        c = self.config
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        fns = kernels.row_functions
        qkv = kernels.rows(lambda rows: self._qkv(rows, fns), x)
        q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
        q = fns.rope_write(
            q.reshape(-1, c.num_heads, c.head_dim),
            k.reshape(-1, c.num_kv_heads, c.head_dim),
            v.reshape(-1, c.num_kv_heads, c.head_dim),
            *rope,
            cache.k[layer],
            cache.v[layer],
            step.slots,
            step.positions,
        )
        attended = kernels.attention(q, cache, layer, step).flatten(-2)
        x = x + kernels.rows(self.o_proj, attended)
        return x + kernels.rows(lambda rows: self._mlp(rows, fns), x)


class Decoder(nn.Module):
    """Embedding → layers → final norm → LM head, over the rows of a :class:`Step`."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.rope_cos: Tensor
        self.rope_sin: Tensor

    def set_rope_table(self, positions: int, freq_divisors: Sequence[float] | None = None) -> None:
        """cos/sin of every position, computed in float32, kept in the model dtype (as the references do)."""
        inv = torch.tensor(rope_inverse_frequencies(self.config), dtype=torch.float32)
        if freq_divisors is not None:  # Llama 3.1 GGUFs: scaling given as per-pair divisors
            inv = inv / torch.tensor(list(freq_divisors), dtype=torch.float32)
        angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
        angles = torch.cat([angles, angles], dim=-1)
        dtype, device = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        self.register_buffer("rope_cos", angles.cos().to(device, dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(device, dtype), persistent=False)

    def forward(
        self, step: Step, cache: KVCache, kernels: Kernels, capture: Sequence[int] = (), head: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """Logits ``[R, vocab]`` float32 of ``step.logit_rows`` (``head=False``: the final-normed hidden
        state of every row, ``[N, hidden]``, for a CUDA graph that leaves the LM head to its caller), and
        the outputs of the ``capture`` layers for every row (``[N, len(capture), hidden]``, or None)."""
        x = self.embed_tokens(step.token_ids)
        rope = (self.rope_cos[step.positions][:, None], self.rope_sin[step.positions][:, None])
        captured: list[Tensor] = []
        for index, layer in enumerate(self.layers):
            x = layer(x, step, rope, cache, index, kernels)
            if index in capture:
                captured.append(x)
        hidden = torch.stack(captured, dim=1) if captured else None
        if not head:  # the norm in tiles too: exact mode's graphs end here
            return kernels.rows(self.norm, x), hidden
        logits = kernels.rows(lambda rows: self.lm_head(self.norm(rows)), x[step.logit_rows]).float()
        return logits, hidden
