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


def build_row_step(
    chunks: Sequence[DecodeChunk], device: torch.device, *, scratch_slot: int, padded_rows: int | None = None
) -> Step:
    """The step for the row attention: the chunks' rows back to back, then (``padded_rows``, a CUDA graph's
    bucket) padding rows at position 0 of the scratch slot, which see only the key they write themselves.

    Example: chunks of 3 and 2 rows padded to 8 → rows 0-2, 3-4, then 3 padding rows; logits of each
    chunk's last ``num_logits`` rows.
    """
    lengths = [len(c.tokens) for c in chunks]
    rows = sum(lengths) if padded_rows is None else padded_rows
    if rows < sum(lengths):
        raise ValueError(f"chunks of {lengths} rows do not fit {padded_rows} rows")
    inputs = np.zeros((3, rows), np.int64)  # token ids, positions, slots: one host array, one upload
    inputs[2] = scratch_slot
    logit_rows: list[int] = []
    start = 0
    for chunk, n in zip(chunks, lengths, strict=True):
        inputs[0, start : start + n] = chunk.tokens
        inputs[1, start : start + n] = np.arange(chunk.start_pos, chunk.start_pos + n)
        inputs[2, start : start + n] = chunk.seq_id
        logit_rows.extend(range(start + n - chunk.num_logits, start + n))
        start += n
    staged = torch.from_numpy(np.concatenate([inputs.reshape(-1), np.array(logit_rows, np.int64)]))
    if device.type == "cuda":
        staged = staged.pin_memory()  # so the copy below is asynchronous
    on_device = staged.to(device, non_blocking=True)
    one = len(chunks) == 1 and padded_rows is None
    return Step(
        token_ids=on_device[:rows],
        positions=on_device[rows : 2 * rows],
        slots=on_device[2 * rows : 3 * rows],
        logit_rows=on_device[3 * rows :],
        only_slot=chunks[0].seq_id if one else None,
        from_start=one and chunks[0].start_pos == 0,
    )


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
