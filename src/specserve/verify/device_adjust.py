"""Torch counterpart of verify/adjust.py: a step's logit adjustments applied on the logits' device.

The host gathers every request's small arrays (bitmask words, bias ids and values, seen ids and counts)
and sends them in one non-blocking copy per dtype for the whole step (backends/torch/transfer.py); the
vocabulary-wide work (unpacking the mask, masking, penalising) runs where the logits are, request by
request, with the same float32 arithmetic as the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from specserve.backends.torch.transfer import upload
from specserve.verify.adjust import LogitAdjustment
from specserve.verify.types import VerifyRequest


def adjusted_logits(
    target_logits: torch.Tensor,  # [rows, vocab] float32/bf16/fp16, not changed
    requests: Sequence[VerifyRequest],
) -> torch.Tensor:  # [rows, vocab] float32: a copy with every request's adjustment applied to its rows
    """The step's logits as each request's target distribution sees them (float32, as the host applies
    them: a bf16 logit minus a penalty is rounded once, in float32)."""
    adjusted = target_logits.float().clone()
    spans: list[tuple[int, int, LogitAdjustment]] = []
    start = 0
    for request in requests:
        end = start + request.num_rows
        if request.adjustment is not None:
            spans.append((start, end, request.adjustment))
        start = end
    if start != adjusted.shape[0]:
        raise ValueError(f"target_logits has {adjusted.shape[0]} rows, the requests {start}")
    per_request = [host_arrays(adjustment) for _, _, adjustment in spans]
    on_device = upload(
        {f"{i}.{n}": a for i, arrays in enumerate(per_request) for n, a in arrays.items()}, adjusted.device
    )
    for i, ((lo, hi, adjustment), arrays) in enumerate(zip(spans, per_request, strict=True)):
        adjust_rows(adjusted[lo:hi], adjustment, {n: on_device[f"{i}.{n}"] for n in arrays})
    return adjusted


def host_arrays(adjustment: LogitAdjustment) -> dict[str, npt.NDArray[np.generic]]:
    """What :func:`adjust_rows` reads of ``adjustment``, as host arrays to upload."""
    arrays: dict[str, npt.NDArray[np.generic]] = {}
    if adjustment.allowed is not None:
        arrays["words"] = np.ascontiguousarray(adjustment.allowed, dtype=np.int32)  # [rows, words]
    if adjustment.bias_ids.size:
        arrays["bias_ids"] = adjustment.bias_ids  # [m] int64
        arrays["bias_values"] = adjustment.bias_values  # [m] float32
    if adjustment.seen_ids.shape[1]:
        real = adjustment.seen_ids >= 0
        arrays["rows"] = np.nonzero(real)[0].astype(np.int64)  # [n]: the row of each seen id
        arrays["ids"] = adjustment.seen_ids[real]  # [n] int64
        arrays["counts"] = adjustment.output_counts[real].astype(np.float32)  # [n], exact below 2**24
    return arrays


def adjust_rows(
    logits: torch.Tensor,  # [rows, vocab] float32, changed in place
    adjustment: LogitAdjustment,
    arrays: dict[str, torch.Tensor] | None = None,  # host_arrays(adjustment) on the device; None: uploads
) -> None:
    """:func:`~specserve.verify.adjust.adjust_logits` on a tensor."""
    if logits.shape[0] != adjustment.num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows, the adjustment {adjustment.num_rows}")
    device, vocab = logits.device, logits.shape[1]
    if arrays is None:
        arrays = upload(host_arrays(adjustment), device)
    if "words" in arrays:
        words = arrays["words"]
        shifts = torch.arange(32, dtype=torch.int32, device=device)  # made there: nothing to upload
        bits = (words[:, :, None] >> shifts) & 1  # [rows, words, 32]
        allowed = bits.reshape(words.shape[0], -1)[:, :vocab].bool()
        logits.masked_fill_(~allowed, float("-inf"))
    if "bias_ids" in arrays:
        logits[:, arrays["bias_ids"]] += arrays["bias_values"][None, :]
    if "ids" not in arrays:
        return
    rows, ids, counts = arrays["rows"], arrays["ids"], arrays["counts"]
    values = logits[rows, ids]
    if adjustment.repetition != 1.0:
        values = torch.where(values > 0, values / adjustment.repetition, values * adjustment.repetition)
    logits[rows, ids] = values - (adjustment.frequency * counts + adjustment.presence * (counts > 0).float())
