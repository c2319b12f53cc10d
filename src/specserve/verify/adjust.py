"""What a request changes in its target logits before the target chooses: a grammar's mask, ``logit_bias``,
and the repetition, frequency and presence penalties — on the host (numpy); verify/device_adjust.py does the
same on tensors.

The changed logits *are* the target distribution of that request (as in vLLM and the OpenAI reference), so
greedy takes their argmax and sampling filters them; rejection sampling against them stays lossless. Each row
is changed for the output it would follow: row ``j`` of a verify step counts the committed output plus the
first ``j`` drafts, and carries the grammar's mask after those drafts, so a verified row is changed exactly as
plain decoding would change it at that position.

Order (vLLM's): mask (forbidden tokens to ``-inf``), ``logit_bias`` added, repetition penalty (a logit of a
token seen in the prompt or output divided by it when positive, multiplied when not), then
``frequency * count + presence`` subtracted for tokens in the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from specserve.request import SamplingParams

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class LogitAdjustment:
    """One request's changes to its ``rows`` target rows (see the module docstring for the order)."""

    allowed: npt.NDArray[np.int32] | None  # [rows, ceil(vocab / 32)] int32 bitmask, or None: no grammar
    """Bit ``i`` of word ``w`` allows token ``32 * w + i`` (llguidance's layout)."""
    bias_ids: IntArray  # [m] int64
    bias_values: npt.NDArray[np.float32]  # [m] float32
    seen_ids: IntArray  # [rows, s] int64, -1-padded: tokens in the prompt (if repetition) or the output
    output_counts: IntArray  # [rows, s] int64: occurrences of seen_ids[r, i] in the output before row r
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0

    @property
    def num_rows(self) -> int:
        return int(self.seen_ids.shape[0])


def build_adjustment(
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    draft_ids: Sequence[int],  # [k]: row j follows the output plus draft_ids[:j]
    allowed: npt.NDArray[np.int32] | None = None,  # [k + 1, words] from the request's grammar
) -> LogitAdjustment | None:
    """The adjustment of a request's ``k + 1`` verify rows, or None when it changes nothing."""
    rows = len(draft_ids) + 1
    if allowed is not None and allowed.shape[0] != rows:
        raise ValueError(f"allowed has {allowed.shape[0]} rows, the request {rows}")
    if not params.penalized and allowed is None:
        return None
    bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
    bias_values = np.array([b for _, b in params.logit_bias], dtype=np.float32)
    counts_only = params.frequency_penalty or params.presence_penalty
    if params.repetition_penalty == 1.0 and not counts_only:
        empty = np.zeros((rows, 0), dtype=np.int64)
        return LogitAdjustment(allowed, bias_ids, bias_values, empty, empty)
    # The committed output is counted once per step; each row adds only its drafts (a long output or prompt
    # must not be re-sorted per row).
    base_ids, base_counts = np.unique(np.asarray(output_ids, dtype=np.int64), return_counts=True)
    prompt_only = np.empty(0, dtype=np.int64)
    if params.repetition_penalty != 1.0:
        prompt_only = np.setdiff1d(np.asarray(prompt_ids, dtype=np.int64), base_ids)
    drafts = np.asarray(draft_ids, dtype=np.int64)
    seen_rows, count_rows = [], []
    for j in range(rows):
        ids, counts = base_ids, base_counts
        if j:
            merged, inverse = np.unique(np.concatenate([base_ids, drafts[:j]]), return_inverse=True)
            weights = np.concatenate([base_counts, np.ones(j, dtype=np.int64)])
            ids, counts = merged, np.bincount(inverse, weights=weights).astype(np.int64)
        extra = prompt_only[~np.isin(prompt_only, drafts[:j])] if j and prompt_only.size else prompt_only
        seen_rows.append(np.concatenate([ids, extra]))
        count_rows.append(np.concatenate([counts, np.zeros(extra.size, dtype=np.int64)]))
    width = max(r.size for r in seen_rows)
    seen = np.full((rows, width), -1, dtype=np.int64)
    output_counts = np.zeros((rows, width), dtype=np.int64)
    for j in range(rows):
        seen[j, : seen_rows[j].size] = seen_rows[j]
        output_counts[j, : count_rows[j].size] = count_rows[j]
    return LogitAdjustment(
        allowed,
        bias_ids,
        bias_values,
        seen,
        output_counts,
        params.repetition_penalty,
        params.frequency_penalty,
        params.presence_penalty,
    )


def allowed_tokens(
    allowed: npt.NDArray[np.int32],  # [rows, words] int32 bitmask
    vocab: int,
) -> npt.NDArray[np.bool_]:  # [rows, vocab] bool
    """The bitmask unpacked: ``[r, t]`` is whether token ``t`` is allowed at row ``r``."""
    bits = np.unpackbits(np.ascontiguousarray(allowed).view(np.uint8), axis=-1, bitorder="little")
    unpacked: npt.NDArray[np.bool_] = bits[:, :vocab].astype(np.bool_)
    return unpacked


def adjust_logits(
    logits: npt.NDArray[np.float32],  # [rows, vocab] float32, changed in place
    adjustment: LogitAdjustment,
) -> None:
    """Apply ``adjustment`` to a request's rows, in place."""
    if logits.shape[0] != adjustment.num_rows:
        raise ValueError(f"logits has {logits.shape[0]} rows, the adjustment {adjustment.num_rows}")
    vocab = logits.shape[1]
    if adjustment.allowed is not None:
        logits[~allowed_tokens(adjustment.allowed, vocab)] = -np.inf
    if adjustment.bias_ids.size:
        logits[:, adjustment.bias_ids] += adjustment.bias_values[None, :]
    if adjustment.seen_ids.shape[1] == 0:
        return
    real = adjustment.seen_ids >= 0
    rows = np.nonzero(real)[0]
    ids = adjustment.seen_ids[real]
    counts = adjustment.output_counts[real]
    values = logits[rows, ids]  # float32 throughout, as on a device
    if adjustment.repetition != 1.0:
        repetition = np.float32(adjustment.repetition)
        values = np.where(values > 0, values / repetition, values * repetition)
    counts32 = counts.astype(np.float32)
    penalty = np.float32(adjustment.frequency) * counts32 + np.float32(adjustment.presence) * (counts32 > 0)
    logits[rows, ids] = values - penalty
