"""Timing primitives of the GPU check: one-token decode steps, and single calls of n rows.

Every timed call ends with ``runtime.synchronize()``: a CUDA runtime returns before its kernels have run,
and a serving step needs its logits before the next one anyway. Configurations measured together are
interleaved call by call, so clock and thermal drift spread over all of them alike; medians, not means, so
that one preempted call does not move a ratio. A first, untimed pass warms every shape (CUDA graph capture,
cuBLAS workspaces, the allocator).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.backends.base import DecodeChunk
from specserve.backends.torch.runtime import TorchRuntime


def context_tokens(vocab: int, n: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random context of ``n`` token ids over the whole vocabulary."""
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def _timed(runtime: TorchRuntime, chunks: Sequence[DecodeChunk]) -> float:
    start = time.perf_counter()
    runtime.decode(chunks)
    runtime.synchronize()
    return time.perf_counter() - start


def decode_steps(
    runtime: TorchRuntime, batch: int, context: int, steps: int, blocks: int, until: float = float("inf")
) -> dict[str, float]:
    """Median seconds of a one-token step of ``batch`` sequences after ``context`` tokens each: ``blocks``
    timed blocks of ``steps`` steps (positions advance within a block, then roll back), after one warm-up
    block over the very same positions; past ``until`` (``perf_counter``) no block starts after the first
    timed one."""
    tokens = context_tokens(runtime.config.vocab_size, context)
    for s in range(batch):
        runtime.free(s)
        runtime.decode([DecodeChunk(s, tokens, 0, 1)])
    per_block = []
    for block in range(blocks + 1):
        if block > 1 and time.perf_counter() > until:
            break
        elapsed = 0.0
        for i in range(steps):
            chunks = [DecodeChunk(s, [tokens[i % context]], context + i, 1) for s in range(batch)]
            elapsed += _timed(runtime, chunks)
        if block:
            per_block.append(elapsed / steps)
        for s in range(batch):
            runtime.truncate(s, context)
    for s in range(batch):
        runtime.free(s)
    step = statistics.median(per_block)
    return {"step_ms": step * 1000, "tokens_per_s": batch / step}


def decode_new_positions(runtime: TorchRuntime, context: int, steps: int) -> dict[str, float]:
    """One sequence's one-token steps at positions this runtime has not run before (as serving meets them:
    every step a new key length), after ``context`` tokens: median and slowest step ms. A kernel that
    builds a plan per key length (cuDNN's SDPA) pays here, and not in :func:`decode_steps`, whose timed
    blocks replay the positions of its warm-up."""
    tokens = context_tokens(runtime.config.vocab_size, context + steps, seed=2)
    runtime.free(0)
    runtime.decode([DecodeChunk(0, tokens[:context], 0, 1)])
    times = [_timed(runtime, [DecodeChunk(0, [tokens[context + i]], context + i, 1)]) for i in range(steps)]
    runtime.free(0)
    return {"median_step_ms": statistics.median(times) * 1000, "slowest_step_ms": max(times) * 1000}


@dataclass(frozen=True)
class CallSpec:
    """One configuration of :func:`call_costs`: a runtime and the row counts to time on it."""

    key: str
    runtime: TorchRuntime
    rows: tuple[int, ...]


def call_costs(
    specs: Sequence[CallSpec], context: int, reps: int, until: float = float("inf")
) -> dict[str, dict[int, float]]:
    """Median ms of one call of ``n`` rows of one sequence after ``context`` tokens (logits for every row,
    as a verify chunk asks), per spec and row count, interleaved across specs and sizes; past ``until`` no
    round starts after the first timed one."""
    for spec in specs:
        rt = spec.runtime
        rt.free(0)
        rt.decode([DecodeChunk(0, context_tokens(rt.config.vocab_size, context), 0, 1)])
    probe = context_tokens(512, max(max(s.rows) for s in specs), seed=1)
    samples: dict[str, dict[int, list[float]]] = {s.key: {n: [] for n in s.rows} for s in specs}
    for rep in range(reps + 1):  # rep 0 warms every shape up
        if rep > 1 and time.perf_counter() > until:
            break
        for spec in specs:
            for n in spec.rows:
                seconds = _timed(spec.runtime, [DecodeChunk(0, probe[:n], context, n)])
                spec.runtime.truncate(0, context)
                if rep:
                    samples[spec.key][n].append(seconds)
    for spec in specs:
        spec.runtime.free(0)
    return {key: {n: statistics.median(t) * 1000 for n, t in by_n.items()} for key, by_n in samples.items()}


def warm_shapes(runtime: TorchRuntime, rows: Sequence[int], positions: int) -> int:
    """Run every (rows, key bucket) shape a generation up to ``positions`` tokens will meet, once, so that
    timed runs capture no CUDA graph and meet no new kernel shape; returns the graphs captured.

    Slot 0 is filled and freed: call it before a run, not during one.
    """
    positions = min(positions, runtime.cache.positions)
    before = len(runtime.graphs.graphs) if runtime.graphs is not None else 0
    runtime.free(0)
    context = context_tokens(runtime.config.vocab_size, positions)
    ends = sorted({min(positions, 1 << b) for b in range(4, positions.bit_length() + 1)})
    for end in ends:  # a sequence ending at each power of two meets each key bucket
        for n in rows:
            start = end - n
            if start < 0:
                continue
            # A chunk must continue the slot's KV (the runtime's rule): cut it back, or fill it up, to start.
            runtime.truncate(0, start)
            held = runtime.kv_positions(0)
            if held < start:
                runtime.decode([DecodeChunk(0, context[held:start], held, 0)])
            runtime.decode([DecodeChunk(0, [1] * n, start, n)])
    runtime.synchronize()
    runtime.free(0)
    return (len(runtime.graphs.graphs) if runtime.graphs is not None else 0) - before
