"""Batch invariance: is a token's logits row the same whether it is decoded alone or inside a batch?

Exact mode rests on it. A greedy verify pass scores ``k + 1`` positions in one call; plain decoding scores
them one call each. If the backend's kernels round differently by batch size (ggml switches Q4_K gemv to
gemm, Q6_K vec_dot to a tiled kernel, by row count), the two can pick different tokens. specserve's
llama.cpp build carries a patch that makes every row independent of its batch-mates
(``patches/llama.cpp-batch-invariant.patch``); this check proves it on the model actually loaded, because a
stock wheel, another CPU or a weight type the patch does not cover can still break it.

The check (``check_batch_invariance``): after a short context, decode ``rows`` positions in one call, then
the same positions one token per call from the same context, and compare every logits row bit for bit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from specserve.backends.base import DecodeChunk, ModelRuntime, to_host

log = logging.getLogger("specserve.invariance")

CHECK_ROWS = 16
"""Rows of the batched call at least: a 16-row repacked gemm block, past stock ggml's 8-row tiled switch."""


def check_rows(tiled_min_batch: int | None) -> int:
    """Rows of the batched call for a build whose tiled K-quant kernel starts at ``tiled_min_batch`` rows.

    The call must reach every kernel a verify batch can: the tiled kernel, and the repacked gemm's 16-row
    blocks, its 4-row blocks and the one-row gemv for the rest (hence + 5: 16k + 4 + 1 rows)."""
    if tiled_min_batch is None:
        return CHECK_ROWS
    return max(CHECK_ROWS, tiled_min_batch + 5)


CONTEXT_TOKENS = 8


@dataclass(frozen=True)
class InvarianceResult:
    """Outcome of one check: the rows compared and the largest absolute logit difference found."""

    rows: int
    max_abs_diff: float
    first_mismatch: int | None  # row index (0-based, in the batched call) of the first differing row

    @property
    def ok(self) -> bool:
        return self.first_mismatch is None

    def describe(self) -> str:
        if self.ok:
            return f"{self.rows}-row batch equals one-token decoding bit for bit"
        return (
            f"row {self.first_mismatch} of a {self.rows}-row batch differs from one-token decoding "
            f"(max |logit difference| {self.max_abs_diff:.3g})"
        )


def check_tokens(runtime: ModelRuntime[Any], n: int) -> list[int]:
    """``n`` ordinary token ids of the model, from fixed text (repeated if the vocabulary is coarse)."""
    text = "def check(values):\n    return [value * 2 for value in values if value]\n"
    tokens = runtime.tokenize(text, add_special=False)
    if not tokens:
        raise ValueError("the model tokenizes the check text to nothing")
    return (tokens * (n // len(tokens) + 1))[:n]


def check_batch_invariance(
    runtime: ModelRuntime[Any], seq_id: int = 0, rows: int = CHECK_ROWS
) -> InvarianceResult:
    """Compare ``rows`` logits rows of one batched call with one-token decoding (sequence left empty).

    Precondition: ``runtime.decode`` runs a chunk of ``rows`` tokens as one backend call.
    """
    rows = max(1, min(rows, runtime.info.context_per_sequence - CONTEXT_TOKENS))
    tokens = check_tokens(runtime, CONTEXT_TOKENS + rows)
    context, probe = tokens[:CONTEXT_TOKENS], tokens[CONTEXT_TOKENS:]
    runtime.free(seq_id)
    try:
        runtime.decode([DecodeChunk(seq_id, context, 0, 0)])
        batched = to_host(runtime.decode([DecodeChunk(seq_id, probe, CONTEXT_TOKENS, rows)])[0]).copy()
        runtime.truncate(seq_id, CONTEXT_TOKENS)
        singles = np.stack(
            [
                to_host(runtime.decode([DecodeChunk(seq_id, [token], CONTEXT_TOKENS + i, 1)])[0])[0].copy()
                for i, token in enumerate(probe)
            ]
        )
    finally:
        runtime.free(seq_id)
    equal = [np.array_equal(batched[i], singles[i]) for i in range(rows)]
    first = next((i for i, same in enumerate(equal) if not same), None)
    diff = float(np.max(np.abs(batched.astype(np.float64) - singles))) if first is not None else 0.0
    return InvarianceResult(rows=rows, max_abs_diff=diff, first_mismatch=first)
