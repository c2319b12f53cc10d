"""Torch counterpart of verify/adjust.py: a step's logit adjustments applied on the logits' device.

The host builds each request's small arrays (bitmask words, seen ids and counts); they travel in one copy
per array, and the vocabulary-wide work (unpacking the mask, masking, penalising) runs where the logits are.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specserve.verify.adjust import LogitAdjustment
from specserve.verify.types import VerifyRequest

_BITS = torch.arange(32, dtype=torch.int32)


def adjusted_logits(
    target_logits: torch.Tensor,  # [rows, vocab] float32/bf16/fp16, not changed
    requests: Sequence[VerifyRequest],
) -> torch.Tensor:  # [rows, vocab] float32: a copy with every request's adjustment applied to its rows
    """The step's logits as each request's target distribution sees them (float32, as the host applies
    them: a bf16 logit minus a penalty is rounded once, in float32)."""
    adjusted = target_logits.float().clone()
    start = 0
    for request in requests:
        end = start + request.num_rows
        if request.adjustment is not None:
            adjust_rows(adjusted[start:end], request.adjustment)
        start = end
    if start != adjusted.shape[0]:
        raise ValueError(f"target_logits has {adjusted.shape[0]} rows, the requests {start}")
    return adjusted


def adjust_rows(
    logits: torch.Tensor,  # [rows, vocab] float32, changed in place
    adjustment: LogitAdjustment,
) -> None:
    """:func:`~specserve.verify.adjust.adjust_logits` on a tensor."""
    if logits.shape[0] != adjustment.num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows, the adjustment {adjustment.num_rows}")
    device, vocab = logits.device, logits.shape[1]
    if adjustment.allowed is not None:
        words = torch.from_numpy(np.ascontiguousarray(adjustment.allowed)).to(device)
        bits = (words[:, :, None] >> _BITS.to(device)) & 1  # [rows, words, 32]
        allowed = bits.reshape(words.shape[0], -1)[:, :vocab].bool()
        logits.masked_fill_(~allowed, float("-inf"))
    if adjustment.bias_ids.size:
        ids = torch.from_numpy(adjustment.bias_ids).to(device)
        logits[:, ids] += torch.from_numpy(adjustment.bias_values).to(device)[None, :]
    if adjustment.seen_ids.shape[1] == 0:
        return
    real = adjustment.seen_ids >= 0
    rows = torch.from_numpy(np.nonzero(real)[0]).to(device)
    ids = torch.from_numpy(adjustment.seen_ids[real]).to(device)
    counts = torch.from_numpy(adjustment.output_counts[real]).to(device).float()
    values = logits[rows, ids]
    if adjustment.repetition != 1.0:
        values = torch.where(values > 0, values / adjustment.repetition, values * adjustment.repetition)
    logits[rows, ids] = values - (adjustment.frequency * counts + adjustment.presence * (counts > 0).float())
