"""The DFlash2 selector's walk through a block's candidates (DFlash without a selector: the argmax, or a
sample of each position's softmax), greedy or sampled with the request's draft uniforms."""

from __future__ import annotations

import torch
from torch import Tensor

from specserve.backends.torch.dflash2 import BlockDrafterNet
from specserve.verify.device_sampling import sample_inverse_cdf


def walk(
    net: BlockDrafterNet,
    hidden: Tensor,  # [S, P, hidden]: drafter states of block positions 1 … P
    logits: Tensor,  # [S, P, vocab] float32
    anchors: Tensor,  # [S] int64
    temperatures: Tensor,  # [S] float32; 0: greedy
    uniforms: Tensor,  # [S, P] float64 in [0, 1): the draws of sampled sequences
    sampling: bool,  # whether any temperature is > 0, known on the host: the walk never waits for the device
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The drafted path ``[S, P]`` int64 and, when any sequence samples, each position's draft
    distribution: ``q [S, P, K]`` float32 over ``candidates [S, P, K]`` (DFlash2), or ``q [S, P, vocab]``
    with ``candidates`` None (DFlash, no selector). A greedy row's ``q`` is its softmax at temperature 1,
    never handed to a verifier (greedy drafts are verified one-hot)."""
    sampled = temperatures > 0
    scale = torch.where(sampled, temperatures, 1.0)[:, None]
    if net.candidate_selector is None:
        greedy = logits.argmax(-1)
        if not sampling:
            return greedy, None, None
        q = torch.softmax(logits / scale[..., None], dim=-1)
        tokens = torch.where(sampled[:, None], inverse_cdf(q, uniforms), greedy)
        return tokens, q, None
    selector = net.candidate_selector
    unary, candidates = torch.topk(logits, selector.top_k, dim=-1)  # [S, P, K], best first
    projected = selector.hidden_projection(hidden)  # [S, P, rank]
    predecessor, path, q_rows = anchors, [], []
    for position in range(hidden.shape[1]):
        scores = selector.scores(
            projected[:, position], unary[:, position], candidates[:, position], predecessor
        )
        index = scores.argmax(-1)
        if sampling:
            q = torch.softmax(scores / scale, dim=-1)
            index = torch.where(sampled, inverse_cdf(q, uniforms[:, position]), index)
            q_rows.append(q)
        predecessor = candidates[:, position].gather(-1, index[:, None])[:, 0]
        path.append(predecessor)
    tokens = torch.stack(path, dim=1)
    return tokens, (torch.stack(q_rows, dim=1) if q_rows else None), candidates


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF draws of ``probs [..., n]`` with ``uniforms [...]`` (the verifier's own sampler, so a
    draft is drawn as a target token would be)."""
    flat = sample_inverse_cdf(probs.reshape(-1, probs.shape[-1]).double(), uniforms.reshape(-1).double())
    # A row without mass (NaN logits) comes back -1: kept in range here (a -1 gather is a device-side
    # assert on a GPU); the drafter refuses the proposal once the ids are on the host.
    return flat.view(uniforms.shape).clamp_min(0)
