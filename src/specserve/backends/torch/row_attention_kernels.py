# mypy: disable-error-code="no-untyped-def, untyped-decorator"
# (Triton kernels take pointers and constexprs that Python's types do not describe.)
"""The Triton kernels of :mod:`.row_attention` (imported only when that attention runs: Triton is optional).

Two launches per layer. ``split_kernel`` (grid ``[rows, kv_heads, max_splits]``): one program reads the keys
``[split * SPLIT_KEYS, min((split + 1) * SPLIT_KEYS, length))`` of one row's slot for one KV head, once for
all the query heads of its group (grouped-query attention without expanding K/V), and leaves the split's
running max, sum and unnormalised output. ``merge_kernel`` (grid ``[rows, heads]``) combines the row's
splits in split order. Every number a row's result depends on comes from that row alone (its query, its
slot's keys, its own length; the split size is fixed when the runtime loads), so a row gets the same bits
whatever else shares its launch: batch-invariant by construction, as exact mode needs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """``a @ b`` accumulated in float32. ``WIDEN``: 16-bit operands widened to float32 first (exact: a
    product of two bf16 or fp16 values is exact in float32), for Triton's interpreter, whose 16-bit dot
    returns garbage (seen with Triton 3.9 on a CPU)."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def split_kernel(
    q_ptr,  # [rows, heads, HEAD_DIM]
    k_ptr,  # [slots, positions, kv_heads, HEAD_DIM] (one layer of the cache)
    v_ptr,
    slots_ptr,  # [rows] int64
    positions_ptr,  # [rows] int64: the row attends to keys 0 .. position
    acc_ptr,  # [rows, heads, MAX_SPLITS, HEAD_DIM] float32
    max_ptr,  # [rows, heads, MAX_SPLITS] float32
    sum_ptr,  # [rows, heads, MAX_SPLITS] float32
    stride_q_row,
    stride_q_head,
    stride_k_slot,
    stride_k_pos,
    stride_k_head,
    stride_v_slot,
    stride_v_pos,
    stride_v_head,
    scale_log2,  # head_dim ** -0.5 * log2(e): scores in base 2
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(positions_ptr + row) + 1
    start = split * SPLIT_KEYS
    end = tl.minimum(start + SPLIT_KEYS, length)
    slot = tl.load(slots_ptr + row)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    in_group = g < GROUP
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
        mask=in_group[:, None],
        other=0.0,
    )
    k_base = k_ptr + slot * stride_k_slot + kv_head * stride_k_head
    v_base = v_ptr + slot * stride_v_slot + kv_head * stride_v_head

    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for block in range(start, end, BLOCK_N):
        n = block + tl.arange(0, BLOCK_N)
        valid = n < end
        k = tl.load(k_base + n[:, None] * stride_k_pos + d[None, :], mask=valid[:, None], other=0.0)
        scores = _dot(q, tl.trans(k), PRECISION, WIDEN) * scale_log2  # [BLOCK_G, BLOCK_N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        v = tl.load(v_base + n[:, None] * stride_v_pos + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * rescale[:, None] + _dot(weights.to(v.dtype), v, PRECISION, WIDEN)
        running_max = new_max

    written = in_group & (start + 0 * g < length)  # a block: the interpreter masks with blocks only
    at = (row * NUM_HEADS + heads) * MAX_SPLITS + split  # [BLOCK_G]
    tl.store(acc_ptr + at[:, None] * HEAD_DIM + d[None, :], acc, mask=written[:, None])
    tl.store(max_ptr + at, running_max, mask=written)
    tl.store(sum_ptr + at, running_sum, mask=written)


@triton.jit
def merge_kernel(
    out_ptr,  # [rows, heads, HEAD_DIM], the model dtype
    positions_ptr,  # [rows] int64
    acc_ptr,  # [rows, heads, MAX_SPLITS, HEAD_DIM] float32
    max_ptr,  # [rows, heads, MAX_SPLITS] float32
    sum_ptr,  # [rows, heads, MAX_SPLITS] float32
    stride_out_row,
    stride_out_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT_KEYS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    length = tl.load(positions_ptr + row) + 1
    splits = tl.cdiv(length, SPLIT_KEYS)
    base = (row * NUM_HEADS + head) * MAX_SPLITS
    d = tl.arange(0, HEAD_DIM)
    overall_max = tl.load(max_ptr + base)
    for s in range(1, splits):
        overall_max = tl.maximum(overall_max, tl.load(max_ptr + base + s))
    total = overall_max * 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s in range(0, splits):  # in split order: the same sum for the row whatever else runs
        weight = tl.exp2(tl.load(max_ptr + base + s) - overall_max)
        total += weight * tl.load(sum_ptr + base + s)
        acc += weight * tl.load(acc_ptr + (base + s) * HEAD_DIM + d)
    out = acc / total
    tl.store(out_ptr + row * stride_out_row + head * stride_out_head + d, out.to(out_ptr.dtype.element_ty))
