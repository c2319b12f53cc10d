"""CUDA graphs for the decode and verify steps of the fast kernels.

A step of a few rows on a GPU is launch-bound in eager mode (a dozen kernels per layer); replaying a graph
captured for its shape costs one launch. A shape (:class:`~.step_inputs.Padding`) is a bucket of
(chunks, tokens per chunk, keys per chunk), each a power of two, for steps of at most
:data:`MAX_GRAPH_ROWS` padded rows; longer steps (prompt chunks) run eagerly. Padding rows write into the KV
cache's scratch slot and attend to one padding key only; real rows never see a padding key. The graph ends
at the final norm: the LM head runs outside it on just the rows whose logits are wanted, so a graph holds
``[rows, hidden]`` of output, not ``[rows, vocab]``. Each bucket is captured the first time it is used
(``warm`` captures the decode and verify buckets at load) into one shared memory pool, as nano-vllm does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from specserve.backends.base import DecodeChunk
from specserve.backends.torch.kv_cache import KVCache
from specserve.backends.torch.model import Decoder, Kernels, Step
from specserve.backends.torch.step_inputs import Padding, build_step

log = logging.getLogger("specserve.torch.graphs")

MAX_GRAPH_ROWS = 64
MIN_GRAPH_KEYS = 256


def _power_of_two(n: int, smallest: int = 1) -> int:
    return max(smallest, 1 << (n - 1).bit_length())


class _Graph:
    """One captured forward: the static step it reads, the hidden rows it leaves."""

    def __init__(
        self, model: Decoder, cache: KVCache, kernels: Kernels, step: Step, pool: Any, capture: bool = True
    ) -> None:
        self.step = step
        self.hidden: torch.Tensor
        self.run_eagerly = (lambda: model(self.step, cache, kernels, head=False)[0]) if not capture else None
        if not capture:  # the same static inputs, run without a graph (a CPU test of the layout)
            return
        stream = torch.cuda.Stream(cache.k.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(cache.k.device))
        with torch.cuda.stream(stream):  # warm up outside the capture (cuBLAS workspaces, autotuning)
            for _ in range(2):
                model(step, cache, kernels, head=False)
        torch.cuda.current_stream(cache.k.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.hidden, _ = model(step, cache, kernels, head=False)

    def replay(self, step: Step) -> torch.Tensor:
        """Copy ``step`` (laid out at this graph's padding) into the static inputs and replay."""
        for name in ("token_ids", "positions", "slots", "key_slots", "key_positions", "mask"):
            getattr(self.step, name).copy_(getattr(step, name), non_blocking=True)
        if self.run_eagerly is not None:
            hidden: torch.Tensor = self.run_eagerly()
            return hidden
        self.graph.replay()
        return self.hidden


class GraphRunner:
    """The graphs of one runtime, by padding bucket."""

    def __init__(self, model: Decoder, cache: KVCache, kernels: Kernels, capture: bool = True) -> None:
        """``capture=False``: every bucket runs its static inputs eagerly (tests the layout off a GPU)."""
        self.model, self.cache, self.kernels = model, cache, kernels
        self.graphs: dict[Padding, _Graph] = {}
        self.capture = capture
        self.pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self.failed = False

    def padding_for(self, chunks: Sequence[DecodeChunk]) -> Padding | None:
        """The bucket these chunks run in, or None: run them eagerly."""
        if self.failed:
            return None
        batch = _power_of_two(len(chunks))
        tokens = _power_of_two(max(len(c.tokens) for c in chunks))
        if batch * tokens > MAX_GRAPH_ROWS:
            return None
        end = max(c.start_pos + len(c.tokens) for c in chunks)
        keys = min(_power_of_two(end + 1, MIN_GRAPH_KEYS), self.cache.positions + 1)
        return Padding(batch, tokens, keys)

    def run(self, chunks: Sequence[DecodeChunk], padding: Padding) -> torch.Tensor:
        """Logits ``[R, vocab]`` of the chunks' wanted rows, through the graph of ``padding``."""
        cache = self.cache
        step = build_step(
            chunks,
            cache.k.device,
            max_positions=cache.positions,
            scratch_slot=cache.scratch_slot,
            padding=padding,
        )
        graph = self.graphs.get(padding)
        if graph is None:
            try:
                graph = _Graph(self.model, cache, self.kernels, step, self.pool, self.capture)
            except RuntimeError:
                log.warning("CUDA graph capture failed; decoding eagerly from now on", exc_info=True)
                self.failed = True
                hidden, _ = self.model(step, cache, self.kernels, head=False)
                return self._logits(hidden, step)
            self.graphs[padding] = graph
        return self._logits(graph.replay(step), step)

    def warm(self, max_chunks: int, max_tokens: int) -> int:
        """Capture, at load, the buckets of steps of up to ``max_chunks`` sequences with verify chunks of up
        to ``max_tokens`` rows at the shortest key bucket; returns how many graphs exist. Longer contexts
        capture their key buckets on first use. Writes only positions the slots then forget."""
        slots = min(max_chunks, self.cache.num_slots)
        batch = 1
        while batch <= _power_of_two(slots):
            tokens = 1
            while (
                tokens <= _power_of_two(max_tokens) and batch * tokens <= MAX_GRAPH_ROWS and not self.failed
            ):
                chunks = [DecodeChunk(slot, [0] * tokens, 0, tokens) for slot in range(min(batch, slots))]
                padding = self.padding_for(chunks)
                if padding is not None and padding not in self.graphs:
                    self.run(chunks, padding)
                tokens *= 2
            batch *= 2
        for slot in range(slots):
            self.cache.free(slot)
        return len(self.graphs)

    def _logits(self, hidden: torch.Tensor, step: Step) -> torch.Tensor:
        logits: torch.Tensor = self.model.lm_head(hidden[step.logit_rows]).float()
        return logits
