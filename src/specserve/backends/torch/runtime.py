"""The torch runtime: a :class:`~specserve.backends.base.ModelRuntime` over our own decoder.

It loads a GGUF file (dequantized) or a Hugging Face checkpoint directory, preallocates the KV cache for
``max_sequences`` slots, and evaluates every chunk of a step in one forward pass. Logits stay where the
model is (``logits_device = "torch:<device>"``): the engine hands them to the torch verifier, and only the
emitted token ids cross to the host.

Exact mode (``exact=True``) runs the batch-invariant kernels (:class:`~.model.Kernels` with tiles) and
proves them at load with the same self-check as llama.cpp (``backends/invariance.py``): one 16-row call
against 16 one-token calls, bit for bit. If the check fails the runtime says why and runs the fast
kernels, reporting ``exactness = "off"``: it never claims an exactness it did not prove.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specserve.backends.base import (
    DecodeChunk,
    DecodeError,
    ModelLoadError,
    ModelRuntime,
    RuntimeInfo,
    StepLogits,
    chunk_piece,
    row_offsets,
)
from specserve.backends.invariance import check_batch_invariance
from specserve.backends.torch.graphs import GraphRunner
from specserve.backends.torch.kv_cache import KVCache
from specserve.backends.torch.model import Decoder, Kernels
from specserve.backends.torch.row_attention import choose_row_attention
from specserve.backends.torch.rows import RowFunctions
from specserve.backends.torch.setup import check_model, resolve_dtype
from specserve.backends.torch.step_inputs import build_row_step, build_step
from specserve.backends.torch.weights import load_decoder, open_weights
from specserve.backends.vocabulary import open_vocabulary

log = logging.getLogger("specserve.torch")

TILE_ROWS = {"cpu": 8, "cuda": 32}
"""Rows of every batch-invariant kernel call: where one call costs about what one row costs (a CPU's fp32
matrix product is memory-bound up to ~8 rows, a GPU's bf16 one well past 32)."""

SHORT_CHUNK_ROWS = 32
"""Chunks of at most this many rows (decode and verify) share one forward pass."""
MAX_CALL_ROWS = 512
"""Rows of one forward pass over a long chunk: bounds the attention scores and activations it holds."""


class TorchRuntime(ModelRuntime[torch.Tensor]):
    """A decoder on one torch device with ``max_sequences`` KV slots."""

    def __init__(
        self,
        path: str | Path,
        *,
        context_per_sequence: int = 4096,
        max_sequences: int = 1,
        device: str = "cpu",
        dtype: str = "auto",
        n_threads: int | None = None,
        exact: bool = True,
        self_check: bool = True,
        cuda_graphs: bool = True,
        graph_tokens: int = 16,
        attention: str = "auto",
        compile: bool = False,
        model: Decoder | None = None,
        vocabulary: Any = None,
    ) -> None:
        """``graph_tokens``: a verify chunk of up to this many rows for every slot at once fits the CUDA
        graphs captured at load (``max_sequences * graph_tokens`` rows). ``attention``: ``rows``
        (the Triton kernel over the cache in place), ``masked`` (SDPA over gathered keys; the CPU's) or
        ``auto`` (rows where Triton runs: CUDA). ``model`` and ``vocabulary``: run a decoder built in memory
        instead of loading ``path`` (the GPU check's random weights of real shapes); ``path`` then only
        names it. ``compile``: the row-wise work through torch.compile (rows.py), compiled here, before
        the graphs are captured and the self-check runs; ``compile_seconds`` says how long it took."""
        self._path = Path(path)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("--device cuda: torch sees no CUDA device here")
        if self.device.type == "cpu":
            torch.set_num_threads(n_threads or max(1, os.cpu_count() or 1))
        self.dtype = resolve_dtype(dtype, self.device)
        if model is None:
            try:
                weights = open_weights(self._path)
                model = load_decoder(weights, self.dtype, self.device, context_per_sequence)
            except (OSError, ValueError, KeyError) as exc:
                raise ModelLoadError(f"the torch runtime could not load {self._path}: {exc}") from exc
        self.model = model
        self.config = config = model.config
        check_model(model, self.dtype, self.device, context_per_sequence)
        self.vocab = vocabulary if vocabulary is not None else open_vocabulary(self._path)
        self.cache = KVCache(
            num_layers=config.num_layers,
            num_slots=max_sequences,
            positions=context_per_sequence,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._capture_layers: tuple[int, ...] = ()
        self.hidden: StepLogits[torch.Tensor] | None = None
        self._closed = False
        self.row_attention = choose_row_attention(attention, config, self.device, context_per_sequence)
        self.row_functions = RowFunctions()
        self.kernels = self._kernels(exact)
        self.info = RuntimeInfo(
            path=str(self._path),
            description=f"{config.family} {config.num_layers}L/{config.hidden_size} {self.dtype} torch",
            vocab_size=config.vocab_size,
            context_per_sequence=context_per_sequence,
            max_sequences=max_sequences,
            n_threads=torch.get_num_threads() if self.device.type == "cpu" else 0,
            exact=exact,
            exactness="batch-invariant" if exact else "off",
            kv_bytes_per_token=self.cache.bytes_per_token,
            logits_device=f"torch:{self.device.type}",
            build=f"torch {torch.__version__} {self.device}; attention: {self.attention_kernel}",
        )
        self.graphs: GraphRunner | None = None
        self._graph_rows = max_sequences * graph_tokens if cuda_graphs else 0
        self._events: tuple[Any, Any] | None = None  # CUDA events around the last decode
        self.compile_seconds: float | None = None
        if compile:
            self._compile_rows()
        self._capture_graphs()
        if exact and self_check:
            self._prove_invariance()

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The layers whose outputs ``decode`` leaves in ``hidden`` (a block drafter's features)."""
        return self._capture_layers

    @capture_layers.setter
    def capture_layers(self, layers: tuple[int, ...]) -> None:
        self._capture_layers = tuple(layers)
        if self.graphs is not None and layers:  # their graphs now, not mid-request
            with torch.inference_mode():
                self.graphs.warm(self._capture_layers)

    @property
    def attention_kernel(self) -> str:
        """What attention runs for decode and verify rows (the GPU check records it)."""
        if self.row_attention is not None:
            return self.row_attention.describe()
        return "batch-invariant tiles" if self.kernels.invariant else "SDPA over gathered keys with a mask"

    def _kernels(self, exact: bool) -> Kernels:
        return Kernels(
            TILE_ROWS.get(self.device.type, 32) if exact else None,
            row_attention=self.row_attention,
            row_functions=self.row_functions,
        )

    def _capture_graphs(self) -> None:
        """Every bucket's graph, captured now (CUDA with the row attention): the shapes the engine uses."""
        if not self._graph_rows or self.device.type != "cuda" or self.row_attention is None:
            return
        self.graphs = GraphRunner(self.model, self.cache, self.kernels, self._graph_rows)
        with torch.inference_mode():
            captured = self.graphs.warm()
        log.info("%d CUDA graphs captured (buckets of up to %d rows)", captured, self.graphs.buckets[-1])

    def _compile_rows(self) -> None:
        """Compile the row functions and generate their kernels now, with calls of 1 row (a size Dynamo
        always specializes), 2 and 3 rows (a second size past 1 recompiles fast mode's graph dynamic in the
        rows; exact mode's tiles have one shape whatever the call)."""
        started = time.perf_counter()
        self.row_functions.compile()
        for rows in (1, 2, 3):
            self.decode([DecodeChunk(0, [0] * rows, 0, rows)])
            self.free(0)
        self.synchronize()
        self.compile_seconds = time.perf_counter() - started
        self.info = dataclasses.replace(self.info, build=f"{self.info.build}; compiled rows")
        log.info("row functions compiled in %.1f s", self.compile_seconds)

    def _prove_invariance(self) -> None:
        result = check_batch_invariance(self)
        if result.ok:
            self.info = dataclasses.replace(self.info, exactness_note=result.describe())
            return
        note = f"batch-invariance self-check failed: {result.describe()}; exact mode is off"
        log.warning("%s", note)
        self.kernels = self._kernels(exact=False)
        self.info = dataclasses.replace(self.info, exact=False, exactness="off", exactness_note=note)
        self._capture_graphs()  # the graphs hold the kernels they were captured with

    # -- evaluation -------------------------------------------------------------------------------

    def decode(self, chunks: Sequence[DecodeChunk]) -> StepLogits[torch.Tensor]:
        if self._closed:
            raise DecodeError(f"{self._path.name}: the runtime is closed")
        self._check(chunks)
        if not chunks:
            return StepLogits(torch.empty(0, self.info.vocab_size, device=self.device), (0,))
        calls = self._pack([len(c.tokens) for c in chunks])
        if self.device.type == "cuda":
            self._events = (_timing_event(), _timing_event())
            self._events[0].record()
        logits: list[list[torch.Tensor]] = [[] for _ in chunks]
        hidden: list[list[torch.Tensor]] = [[] for _ in chunks]
        with torch.inference_mode():
            for call in calls:
                pieces = [chunk_piece(chunks[index], lo, hi) for index, lo, hi in call]
                call_logits, call_hidden = self._forward(pieces)
                whole_step = call_logits.rows  # the rows in chunk order when the step is one pass
                for (index, _, _), rows in zip(call, call_logits, strict=True):
                    logits[index].append(rows)
                for (index, _, _), rows in zip(call, call_hidden or [], strict=False):
                    hidden[index].append(rows)
                for piece in pieces:
                    self.cache.wrote(piece.seq_id, piece.start_pos + len(piece.tokens))
        if self._events is not None:
            self._events[1].record()
        offsets = row_offsets([c.num_logits for c in chunks])
        rows = whole_step if len(calls) == 1 else _cat(logits)
        self.hidden = None
        if self.capture_layers:
            self.hidden = StepLogits(_cat(hidden), row_offsets([len(c.tokens) for c in chunks]))
        return StepLogits(rows, offsets)

    def _forward(
        self, pieces: list[DecodeChunk]
    ) -> tuple[StepLogits[torch.Tensor], StepLogits[torch.Tensor] | None]:
        """One forward pass over chunks that fit one call: their logits (and hidden rows) per chunk."""
        padded = None if self.graphs is None else self.graphs.padding_for(pieces)
        if self.graphs is not None and padded is not None:
            rows, hidden = self.graphs.run(pieces, padded, self.capture_layers)
        elif self.row_attention is not None:
            step = build_row_step(pieces, self.device, scratch_slot=self.cache.scratch_slot)
            rows, hidden = self.model(step, self.cache, self.kernels, self.capture_layers)
        else:
            step = build_step(
                pieces,
                self.device,
                max_positions=self.cache.positions,
                scratch_slot=self.cache.scratch_slot,
                invariant=self.kernels.invariant,
            )
            rows, hidden = self.model(step, self.cache, self.kernels, self.capture_layers)
        logits = StepLogits(rows, row_offsets([p.num_logits for p in pieces]))
        if hidden is None:
            return logits, None
        return logits, StepLogits(hidden, row_offsets([len(p.tokens) for p in pieces]))

    def call_rows(self, chunk_rows: Sequence[int], seq_ids: Sequence[int] | None = None) -> list[int]:
        return [sum(hi - lo for _, lo, hi in call) for call in self._pack(chunk_rows)]

    @staticmethod
    def _pack(chunk_rows: Sequence[int]) -> list[list[tuple[int, int, int]]]:
        """Forward passes for chunks of these sizes, as ``(chunk index, first row, end row)`` pieces: the
        short chunks (decode and verify, at most :data:`SHORT_CHUNK_ROWS`) together in one pass, each
        longer one (a prompt, a draft model's catch-up) alone, cut into pieces of at most
        :data:`MAX_CALL_ROWS`. Batching a long chunk with short ones would pad every chunk to its length.

        Example: ``[3, 5, 700]`` → ``[[(0, 0, 3), (1, 0, 5)], [(2, 0, 512)], [(2, 512, 700)]]``.
        """
        short = [(i, 0, n) for i, n in enumerate(chunk_rows) if n <= SHORT_CHUNK_ROWS]
        calls = [short] if short else []
        for i, n in enumerate(chunk_rows):
            if n > SHORT_CHUNK_ROWS:
                calls.extend([(i, lo, min(lo + MAX_CALL_ROWS, n))] for lo in range(0, n, MAX_CALL_ROWS))
        return calls

    def last_decode_seconds(self) -> float | None:
        """The device time of the last ``decode`` (CUDA events; read once its results were used, so the
        wait is over by then), or None on a CPU, where the caller's wall clock is the measure."""
        if self._events is None:
            return None
        start, end = self._events
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0

    def _check(self, chunks: Sequence[DecodeChunk]) -> None:
        """Refuse, before anything runs, what would corrupt the cache or (on a GPU) the CUDA context."""
        seen = set()
        for c in chunks:
            if not 0 <= c.seq_id < self.cache.num_slots or c.seq_id in seen:
                raise DecodeError(f"sequence id {c.seq_id} is not a free slot of this batch")
            seen.add(c.seq_id)
            if c.start_pos + len(c.tokens) > self.cache.positions:
                raise DecodeError(
                    f"the KV cache is full: sequence {c.seq_id} would reach {c.start_pos + len(c.tokens)} "
                    f"positions of {self.cache.positions}"
                )
            if c.start_pos != self.cache.lengths[c.seq_id]:  # llama.cpp's rule: positions continue the KV
                raise DecodeError(
                    f"sequence {c.seq_id} holds {self.cache.lengths[c.seq_id]} positions; a chunk at "
                    f"{c.start_pos} would leave a gap or overwrite (truncate first)"
                )
            if min(c.tokens) < 0 or max(c.tokens) >= self.info.vocab_size:
                # On a GPU an out-of-range embedding index is a device-side assert that poisons the context.
                raise DecodeError(f"sequence {c.seq_id}: a token id outside [0, {self.info.vocab_size})")

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- KV cache -----------------------------------------------------------------------------------

    def truncate(self, seq_id: int, length: int) -> None:
        self.cache.truncate(seq_id, length)

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)

    def kv_positions(self, seq_id: int) -> int:
        return self.cache.lengths[seq_id]

    def copy_sequence(self, src: int, dst: int, length: int) -> bool:
        self.cache.copy(src, dst, length)
        return True

    def save_sequence(self, seq_id: int) -> bytes | None:
        return self.cache.save(seq_id) if self.cache.lengths[seq_id] else None

    def load_sequence(self, seq_id: int, blob: bytes) -> int:
        return self.cache.load(seq_id, blob)

    # -- vocabulary ---------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        tokens: list[int] = self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)
        return tokens

    def token_bytes(self, token_id: int) -> bytes:
        piece: bytes = self.vocab.token_bytes(token_id)
        return piece

    def is_eog(self, token_id: int) -> bool:
        return bool(self.vocab.is_eog(token_id))

    def is_control(self, token_id: int) -> bool:
        return bool(self.vocab.is_control(token_id))

    def chat_template(self) -> str | None:
        template: str | None = self.vocab.chat_template()
        return template

    def special_token_text(self, which: str) -> str:
        return str(self.vocab.special_token_text(which))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.graphs = None
        self.hidden = None
        self.vocab.close()
        self.cache.release()
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _cat(parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """Chunk after chunk, piece after piece, in one tensor."""
    return torch.cat([piece for chunk in parts for piece in chunk])
