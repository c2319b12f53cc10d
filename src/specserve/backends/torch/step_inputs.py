"""From a step's chunks to the device tensors of one forward pass (:class:`~.model.Step`).

Rows are the chunks' tokens back to back (eager), or laid out ``[batch, tokens]`` at a fixed padded shape
(a CUDA graph's bucket). Attention is per chunk: chunk ``b``'s queries attend to ``[batch, keys]`` key
slots holding its own sequence's positions ``0 .. end - 1``, so its cost grows with the batch, not with
its square. Built on the host from small integer arrays and copied to the device at once; the logits rows
asked for are named here, so the LM head runs on those rows only (eager).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from specserve.backends.base import DecodeChunk
from specserve.backends.torch.model import KEY_BUCKET_MIN, Step

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Padding:
    """A fixed shape to lay a step out in: ``batch`` chunks of ``tokens`` rows over ``keys`` key slots."""

    batch: int
    tokens: int
    keys: int


def key_bucket(position: int, max_positions: int) -> int:
    """The key length the batch-invariant attention uses for a row at ``position``: a power of two at least
    ``position + 1`` (and :data:`KEY_BUCKET_MIN`), capped at the cache size. It depends on nothing else.

    Example: positions 0..63 → 64, 64..127 → 128, 100 with a 100-position cache → 100.
    """
    bucket = max(KEY_BUCKET_MIN, 1 << position.bit_length())
    return min(bucket, max_positions)


def build_step(
    chunks: Sequence[DecodeChunk],
    device: torch.device,
    *,
    max_positions: int,
    scratch_slot: int,
    invariant: bool = False,
    padding: Padding | None = None,
) -> Step:
    """The step for ``chunks``; ``padding`` lays it out at a fixed shape (padding rows and keys point at the
    scratch slot, padding rows see one padding key, real rows never see one)."""
    lengths = [len(c.tokens) for c in chunks]
    batch = padding.batch if padding else len(chunks)
    tokens = padding.tokens if padding else max(lengths)
    ends = [c.start_pos + n for c, n in zip(chunks, lengths, strict=True)]
    keys = padding.keys if padding else max(ends)
    if padding and (len(chunks) > batch or tokens < max(lengths) or keys <= max(ends)):
        raise ValueError(f"chunks of {lengths} rows ending at {ends} do not fit {padding}")

    # Where each chunk's rows go: back to back, or row t of chunk b at b * tokens + t.
    starts = np.cumsum([0, *lengths])[:-1] if padding is None else np.arange(len(chunks)) * tokens
    num_rows = int(sum(lengths)) if padding is None else batch * tokens
    token_ids = np.zeros(num_rows, np.int64)
    positions = np.zeros(num_rows, np.int64)
    slots = np.full(num_rows, scratch_slot, np.int64)
    query_index = np.full((batch, tokens), num_rows, np.int64)  # num_rows: a zero padding query
    key_slots = np.full((batch, keys), scratch_slot, np.int64)
    key_positions = np.zeros((batch, keys), np.int64)
    mask = np.zeros((batch, tokens, keys), np.bool_)
    mask[:, :, -1 if padding else 0] = True  # padding queries: one key, so softmax stays finite
    row_chunk, row_pos = np.zeros(num_rows, np.int64), np.zeros(num_rows, np.int64)
    logit_rows: list[int] = []
    for b, (chunk, n, end) in enumerate(zip(chunks, lengths, ends, strict=True)):
        rows = slice(starts[b], starts[b] + n)
        token_ids[rows] = chunk.tokens
        positions[rows] = np.arange(chunk.start_pos, end)
        slots[rows] = chunk.seq_id
        query_index[b, :n] = np.arange(starts[b], starts[b] + n)
        row_chunk[rows], row_pos[rows] = b, np.arange(n)
        key_slots[b, :end] = chunk.seq_id
        key_positions[b, :end] = np.arange(end)
        mask[b, :n, :] = np.arange(keys)[None, :] <= positions[rows][:, None]
        logit_rows.extend(range(starts[b] + n - chunk.num_logits, starts[b] + n))
    if padding is not None:
        padded_rows = slots == scratch_slot
        row_chunk[padded_rows] = np.arange(num_rows)[padded_rows] // tokens
        row_pos[padded_rows] = np.arange(num_rows)[padded_rows] % tokens
        query_index = np.arange(num_rows).reshape(batch, tokens)

    def put(array: npt.NDArray[np.int64] | npt.NDArray[np.bool_]) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)

    buckets: tuple[tuple[int, torch.Tensor], ...] = ()
    if invariant:
        row_buckets = np.array([key_bucket(int(p), max_positions) for p in positions], np.int64)
        buckets = tuple(
            (int(b), put(np.flatnonzero(row_buckets == b).astype(np.int64))) for b in np.unique(row_buckets)
        )
    only_slot = chunks[0].seq_id if len(chunks) == 1 and padding is None else None
    return Step(
        token_ids=put(token_ids),
        positions=put(positions),
        slots=put(slots),
        query_index=put(query_index),
        row_chunk=put(row_chunk),
        row_pos=put(row_pos),
        key_slots=put(key_slots),
        key_positions=put(key_positions),
        mask=put(mask),
        logit_rows=put(np.array(logit_rows, np.int64)),
        key_buckets=buckets,
        only_slot=only_slot,
    )
