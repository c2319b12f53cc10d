"""What a block drafter is trained to do, and how well it does it.

* A new drafter for a target (:func:`new_drafter`): its layers start as copies of the target's last layer,
  the convolutions as identities (tap 0 passes a position through, the dynamic taps are 0), the rest at
  small random values; the embedding and LM head stay the target's, frozen.
* One training example (:func:`example_loss`): random anchors in the response; each anchor's block
  ``[token, MASK × (B − 1)]`` sees the context features of the positions before it and its own block, all of
  them in one forward (the same layers as inference, block-bidirectional mask); cross-entropy on block
  positions ``k = 1 … B − 1`` against the target's tokens, weighted by ``exp(−(k − 1) / γ)`` (early
  positions decide acceptance); and the selector's K-way cross-entropy over the top-K candidates of the
  block logits (the true token inserted in place of the last candidate when missing), its predecessor the
  true previous token.
* :func:`acceptance_length`: on held-out examples, the greedy block drafted at anchors of the response
  against what the target generated: tokens per verify step (accepted drafts + 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specserve.backends.torch.dflash2 import BlockDrafterNet
from specserve.drafters.dflash2_walk import walk
from specserve.models.block_drafter import BlockDrafterConfig
from specserve.tools.train_drafter.data import Example


def new_drafter(target: nn.Module, config: BlockDrafterConfig, seed: int = 0) -> BlockDrafterNet:
    """A float32 drafter for ``target`` (our torch Decoder), initialised as the module docstring says."""
    torch.manual_seed(seed)
    net = BlockDrafterNet(config).float()
    source: Any = target.layers[-1]  # type: ignore[index] # our Decoder's last DecoderLayer
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    with torch.no_grad():
        for name, param in net.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                nn.init.normal_(param, 0.0, 0.02)
        wq, wk, wv = torch.split(source.qkv_proj.weight.float(), [q, kv, kv])
        gate, up = source.gate_up_proj.weight.float().chunk(2)
        for layer in net.decoder_layers:
            attn = layer.self_attn
            copies = [(attn.q_proj, wq), (attn.k_proj, wk), (attn.v_proj, wv)]
            copies += [(attn.o_proj, source.o_proj.weight), (layer.mlp.down_proj, source.down_proj.weight)]
            copies += [(layer.mlp.gate_proj, gate), (layer.mlp.up_proj, up)]
            for module, weight in copies:
                module.weight.copy_(weight.float())
            if c.attention_bias and source.qkv_proj.bias is not None:
                bq, bk, bv = torch.split(source.qkv_proj.bias.float(), [q, kv, kv])
                attn.q_proj.bias.copy_(bq), attn.k_proj.bias.copy_(bk), attn.v_proj.bias.copy_(bv)
                attn.o_proj.bias.zero_()
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()
    return net


@dataclass(frozen=True)
class Objective:
    block_size: int
    anchors: int = 8
    """Anchors per example and step."""
    gamma: float = 7.0
    """Decay of the position weights ``exp(−(k − 1) / γ)``."""
    selector_weight: float = 1.0


def block_states(
    net: BlockDrafterNet, embed: nn.Embedding, example: Example, anchors: Tensor, block: int
) -> Tensor:  # [A, block - 1, hidden]: drafter states of block positions 1 …
    """One forward over every anchor's block, each seeing the context before it and its own block."""
    c = net.config
    device = embed.weight.device
    features = example.features.to(device=device, dtype=net.fc.weight.dtype)
    context = net.hidden_norm(net.fc(features))  # [C, hidden]
    n_context = context.shape[0]
    cos_c, sin_c = net.rope(torch.arange(n_context, device=device), context.dtype)
    ids = torch.full((anchors.shape[0], block), c.mask_token_id, dtype=torch.long, device=device)
    ids[:, 0] = example.tokens.to(device)[anchors]
    x = embed(ids).to(context.dtype) * c.input_embedding_scale
    positions = anchors[:, None] + torch.arange(block, device=device)[None, :]
    rope = net.rope(positions, x.dtype)
    before = torch.arange(n_context, device=device)[None, :] < anchors[:, None]  # context of each anchor
    visible = torch.cat([before, torch.ones(anchors.shape[0], block, dtype=torch.bool, device=device)], dim=1)
    visible = visible[:, None, None, :].expand(anchors.shape[0], 1, block, n_context + block)
    for layer in net.decoder_layers:
        k, v = layer.self_attn.keys_values(context, cos_c, sin_c)
        shared = (k[None].expand(anchors.shape[0], *k.shape), v[None].expand(anchors.shape[0], *v.shape))
        x = layer(x, rope, shared, visible)
    states: Tensor = net.norm(x)[:, 1:]
    return states


def sample_anchors(example: Example, count: int, block: int, generator: torch.Generator) -> Tensor | None:
    """Up to ``count`` distinct anchors in the response whose whole block has target tokens."""
    low, high = example.prompt_len, example.tokens.shape[0] - block  # anchor a needs tokens a … a + B − 1
    if high < low:
        return None
    choices = torch.randperm(high - low + 1, generator=generator)[:count] + low
    return choices.sort().values


def example_loss(
    net: BlockDrafterNet,
    embed: nn.Embedding,
    head: nn.Module,
    example: Example,
    anchors: Tensor,
    o: Objective,
) -> tuple[Tensor, dict[str, float]]:
    """The weighted block cross-entropy plus the selector's K-way loss, and their values."""
    device = embed.weight.device
    tokens = example.tokens.to(device)
    b = o.block_size
    states = block_states(net, embed, example, anchors, b)  # [A, B-1, hidden]
    targets = tokens[anchors[:, None] + torch.arange(1, b, device=device)[None, :]]  # [A, B-1]
    logits = net.logits(states, head)  # [A, B-1, vocab] float32
    weights = torch.exp(-torch.arange(b - 1, device=device, dtype=torch.float32) / o.gamma)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    lm = (ce * weights).sum() / (weights.sum() * anchors.shape[0])
    top1 = (logits.argmax(-1) == targets).float().mean().item()
    values = {"lm": lm.item(), "top1": top1}
    loss = lm
    selector = net.candidate_selector
    if selector is not None and o.selector_weight > 0:
        detached = logits.detach()
        candidates = detached.topk(selector.top_k, dim=-1).indices  # [A, B-1, K]
        hit = candidates == targets[..., None]
        missing = ~hit.any(-1)
        candidates[..., -1] = torch.where(missing, targets, candidates[..., -1])
        truth = (candidates == targets[..., None]).float().argmax(-1)  # [A, B-1]
        predecessors = tokens[anchors[:, None] + torch.arange(b - 1, device=device)[None, :]]
        projected = selector.hidden_projection(states.detach())  # [A, B-1, rank]
        query = selector.predecessor_codebook(predecessors) * projected
        pairwise = torch.einsum("abr,abkr->abk", query, selector.successor_codebook(candidates))
        scores = detached.gather(-1, candidates) + pairwise
        sel = (
            F.cross_entropy(scores.flatten(0, 1), truth.flatten(), reduction="none").view_as(truth) * weights
        )
        sel = sel.sum() / (weights.sum() * anchors.shape[0])
        loss = loss + o.selector_weight * sel
        values["selector"] = sel.item()
    return loss, values


@torch.no_grad()
def acceptance_length(
    net: BlockDrafterNet,
    embed: nn.Embedding,
    head: nn.Module,
    examples: list[Example],
    block: int,
    every: int = 4,
) -> float:
    """Mean tokens per verify step of greedy drafting at every ``every``-th response position."""
    steps, emitted = 0, 0
    for example in examples:
        low, high = example.prompt_len, example.tokens.shape[0] - block
        if high < low:
            continue
        anchors = torch.arange(low, high + 1, every, device=embed.weight.device)
        states = block_states(net, embed, example, anchors, block)
        logits = net.logits(states, head)
        tokens = example.tokens.to(embed.weight.device)
        zeros = torch.zeros(anchors.shape[0], device=logits.device)
        drafted, _, _ = walk(
            net, states, logits, tokens[anchors], zeros, zeros[:, None].expand(-1, block - 1), sampling=False
        )
        truth = tokens[anchors[:, None] + torch.arange(1, block, device=logits.device)[None, :]]
        accepted = (drafted == truth).long().cumprod(-1).sum(-1)
        steps += anchors.shape[0]
        emitted += int(accepted.sum().item()) + anchors.shape[0]
    return emitted / steps if steps else math.nan
