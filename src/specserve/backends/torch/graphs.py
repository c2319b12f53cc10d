"""CUDA graphs for every serving step of up to the largest bucket's rows, in both kernel modes.

A step of a few rows on a GPU is launch-bound in eager mode (a dozen kernels per layer); replaying a graph
captured for its shape costs one launch. Because the row attention (:mod:`.row_attention`) reads each
row's slot and position from device tensors, a graph's shape is its row count alone: one graph serves any
mix of decode and verify chunks at any key length up to the cache's (no key-length buckets). A step's rows
are padded up to the next bucket (:func:`row_buckets`); padding rows write and read position 0 of the KV
cache's scratch slot. The graph ends at the final norm, optionally with the hidden states of the layers a
block drafter reads (DFlash2): the LM head runs outside it on just the rows whose logits are wanted, so a
graph holds ``[rows, hidden]`` of output, not ``[rows, vocab]``.

``warm`` captures every bucket at load, largest first into one shared memory pool (nano-vllm's order:
smaller graphs reuse the largest one's memory). A failed capture disables its bucket only, and says why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from specserve.backends.base import DecodeChunk
from specserve.backends.torch.kv_cache import KVCache
from specserve.backends.torch.model import Decoder, Kernels, Step
from specserve.backends.torch.step_inputs import build_row_step

log = logging.getLogger("specserve.torch.graphs")

GraphKey = tuple[int, tuple[int, ...]]
"""(padded rows, the captured layers)."""


def row_buckets(max_rows: int, tile_rows: int | None) -> list[int]:
    """The padded row counts graphs are captured for, ascending, up to the first at least ``max_rows``:
    1, 2, 4, 8, 16, then steps of 1.5x and 4/3x (24, 32, 48, 64, 96, ...), so padding costs at most half
    a step's rows; with tiles (exact mode) the multiples of ``tile_rows``, since every call is whole tiles.

    Example: ``row_buckets(40, None)`` → ``[1, 2, 4, 8, 16, 24, 32, 48]``; ``row_buckets(40, 32)`` →
    ``[32, 64]``.
    """
    if tile_rows is not None:
        return [tile_rows * i for i in range(1, -(-max_rows // tile_rows) + 1)]
    buckets = [1, 2, 4, 8, 16]
    while buckets[-1] < max_rows:
        last = buckets[-1]
        buckets.append(last * 3 // 2 if last & (last - 1) == 0 else last * 4 // 3)
    return [b for b in buckets if b < max_rows] + [next(b for b in buckets if b >= max_rows)]


class _Graph:
    """One captured forward: the static step it reads, the hidden rows (and captured layers) it leaves."""

    def __init__(
        self,
        model: Decoder,
        cache: KVCache,
        kernels: Kernels,
        step: Step,
        capture_layers: tuple[int, ...],
        pool: Any,
        capture: bool = True,
    ) -> None:
        self.step = step
        self.outputs: tuple[torch.Tensor, torch.Tensor | None]

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            outputs: tuple[torch.Tensor, torch.Tensor | None] = model(
                self.step, cache, kernels, capture_layers, head=False
            )
            return outputs

        self.run_eagerly = forward if not capture else None
        if not capture:  # the same static inputs, run without a graph (a CPU test of the layout)
            return
        device = cache.k.device
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up outside the capture (cuBLAS workspaces, Triton's compile)
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = forward()

    def replay(self, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Copy ``step`` (laid out at this graph's rows) into the static inputs and replay."""
        for name in ("token_ids", "positions", "slots"):
            getattr(self.step, name).copy_(getattr(step, name), non_blocking=True)
        if self.run_eagerly is not None:
            return self.run_eagerly()
        self.graph.replay()
        return self.outputs


class GraphRunner:
    """The graphs of one runtime, by padded row count (and captured layers)."""

    def __init__(
        self, model: Decoder, cache: KVCache, kernels: Kernels, max_rows: int, capture: bool = True
    ) -> None:
        """``capture=False``: every bucket runs its static inputs eagerly (tests the layout off a GPU)."""
        if kernels.row_attention is None:
            raise ValueError("CUDA graphs need the row attention (a graph cannot hold a per-length mask)")
        self.model, self.cache, self.kernels = model, cache, kernels
        self.buckets = row_buckets(max_rows, kernels.tile_rows)
        self.graphs: dict[GraphKey, _Graph] = {}
        self.failed: dict[GraphKey, str] = {}
        """Buckets whose capture failed, with the error: they run eagerly."""
        self.capture = capture
        self.pool: Any = torch.cuda.graph_pool_handle() if capture else None

    def padding_for(self, chunks: Sequence[DecodeChunk]) -> int | None:
        """The padded row count these chunks run at, or None: too many rows, run them eagerly."""
        rows = sum(len(c.tokens) for c in chunks)
        return next((b for b in self.buckets if b >= rows), None)

    def run(
        self, chunks: Sequence[DecodeChunk], rows: int, capture_layers: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``[R, vocab]`` of the chunks' wanted rows through the graph of ``rows`` padded rows, and
        the captured layers' outputs of their real rows (``[n, len(capture_layers), hidden]``) or None."""
        step = build_row_step(
            chunks, self.cache.k.device, scratch_slot=self.cache.scratch_slot, padded_rows=rows
        )
        key = (rows, capture_layers)
        graph = self.graphs.get(key)
        if graph is None and key not in self.failed:
            try:
                graph = _Graph(
                    self.model, self.cache, self.kernels, step, capture_layers, self.pool, self.capture
                )
                self.graphs[key] = graph
            except RuntimeError as exc:
                log.warning("CUDA graph capture of %d rows failed; that bucket runs eagerly: %s", rows, exc)
                self.failed[key] = str(exc)
        if graph is None:
            hidden, captured = self.model(step, self.cache, self.kernels, capture_layers, head=False)
        else:
            hidden, captured = graph.replay(step)
        real = sum(len(c.tokens) for c in chunks)
        return self._logits(hidden, step), None if captured is None else captured[:real]

    def warm(self, capture_layers: tuple[int, ...] = ()) -> int:
        """Capture every bucket, largest first; returns how many graphs exist. Writes only position 0 of
        the scratch slot."""
        for rows in sorted(self.buckets, reverse=True):
            if (rows, capture_layers) not in self.graphs:
                self.run([DecodeChunk(self.cache.scratch_slot, [0], 0, 1)], rows, capture_layers)
        return len(self.graphs)

    def _logits(self, hidden: torch.Tensor, step: Step) -> torch.Tensor:
        head = self.model.lm_head
        logits: torch.Tensor = self.kernels.rows(head, hidden[step.logit_rows]).float()
        return logits
