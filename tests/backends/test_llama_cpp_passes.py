"""stream_passes against llama.cpp itself: the passes a call really runs, counted by ggml's eval callback."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specserve.backends.base import DecodeChunk
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.backends.llama_cpp_lib import llama_lib
from specserve.backends.llama_cpp_passes import stream_passes
from support.tiny_models import TinyModels

SEQUENCES = 6
CAPACITY = 64


@pytest.mark.parametrize(
    ("pieces", "passes"),
    [
        ([], []),
        ([(0, 1), (1, 1), (2, 1), (3, 1)], [4]),
        ([(1, 1), (2, 1), (3, 1), (0, 1)], [3, 1]),  # token order matters: 0 is not 3 + 1
        ([(0, 1), (2, 1), (3, 1)], [1, 2]),  # a gap: 2 is not 0 + 1
        ([(0, 1), (1, 9), (2, 1), (3, 5)], [4, 8, 4]),
        # Prompts: 16 tokens each twice, 1 each, then 3 and 2 left for sequences 0 and 2 (not consecutive).
        ([(0, 36), (1, 33), (2, 35), (3, 33)], [64, 64, 4, 3, 2]),
        ([(0, 100)], [64, 36]),  # one sequence: cut at the micro-batch size
        ([(0, 40), (1, 40)], [64, 16]),  # at most 64 // 2 tokens each
        ([(0, 2), (0, 3), (1, 5)], [10]),  # pieces of one sequence count together
        ([(2, 0), (0, 1), (1, 1)], [2]),  # an empty piece is no sequence
    ],
)
def test_stream_passes(pieces: list[tuple[int, int]], passes: list[int]) -> None:
    assert stream_passes(pieces, 64) == passes


class PassCounter:
    """A llama.cpp context with one KV stream per sequence whose eval callback records, per graph
    computed, the rows of its first layer's input norm: one entry per pass llama.cpp ran."""

    def __init__(self, path: Path) -> None:
        lib = self.lib = llama_lib()
        self.rows: list[int] = []
        ggml = ctypes.CDLL(str(Path(lib.__file__).parent / "lib" / "libggml-base.so"))
        ggml.ggml_get_name.restype = ctypes.c_char_p
        ggml.ggml_get_name.argtypes = [ctypes.c_void_p]

        def observe(tensor: int, ask: bool, _user: Any) -> bool:
            if ask and ggml.ggml_get_name(tensor) == b"attn_norm-0":
                # struct ggml_tensor: type (4 bytes, padded to 8), buffer pointer, then int64 ne[4].
                self.rows.append(ctypes.c_int64.from_address(tensor + 16 + 8).value)
            return False

        self.callback = lib.ggml_backend_sched_eval_callback(observe)
        mparams = lib.llama_model_default_params()
        self.model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = 128 * SEQUENCES
        cparams.n_batch = cparams.n_ubatch = CAPACITY
        cparams.n_seq_max = SEQUENCES
        cparams.n_threads = cparams.n_threads_batch = 1
        cparams.kv_unified = False
        cparams.cb_eval = self.callback
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        self.batch = lib.llama_batch_init(CAPACITY, 0, 1)
        self.positions = [0] * SEQUENCES

    def decode(self, pieces: list[tuple[int, int]]) -> list[int]:
        """Decode these ``(seq_id, rows)`` pieces in this token order; the rows of each pass run."""
        i = 0
        for seq, n in pieces:
            for _ in range(n):
                self.batch.token[i] = 1 + i % 7
                self.batch.pos[i] = self.positions[seq]
                self.batch.n_seq_id[i] = 1
                self.batch.seq_id[i][0] = seq
                self.batch.logits[i] = 1
                self.positions[seq] += 1
                i += 1
        self.batch.n_tokens = i
        self.rows.clear()
        assert self.lib.llama_decode(self.ctx, self.batch) == 0
        return list(self.rows)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


@pytest.fixture
def counter(tiny_models: TinyModels) -> Iterator[PassCounter]:
    counter = PassCounter(tiny_models.target)
    yield counter
    counter.close()


@pytest.mark.parametrize(
    "pieces",
    [
        [(0, 1), (1, 1), (2, 1), (3, 1)],
        [(1, 1), (2, 1), (3, 1), (0, 1)],
        [(0, 1), (2, 1), (3, 1), (5, 1)],
        [(0, 1), (1, 9), (2, 1), (3, 5)],
        [(3, 4), (1, 2), (2, 7), (4, 1)],
        [(0, 30), (1, 20), (2, 12)],
        [(0, 50), (5, 3)],
    ],
)
def test_stream_passes_are_the_passes_llama_cpp_runs(
    counter: PassCounter, pieces: list[tuple[int, int]]
) -> None:
    """If a new llama.cpp splits calls differently, the policy's prices are wrong: this fails."""
    assert counter.decode(pieces) == stream_passes(pieces, CAPACITY)


def test_the_runtime_writes_a_call_in_sequence_order_and_returns_rows_in_chunk_order(
    tiny_models: TinyModels,
) -> None:
    """Sequences 1, 2, 3, 0 in one step: one pass (call_rows says so), and each chunk gets its own rows,
    the same as decoded in sequence order."""
    rt = LlamaCppRuntime(tiny_models.target, n_threads=1, context_per_sequence=64, max_sequences=4)
    try:
        prompt = [1, 2, 3, 4]
        rt.decode([DecodeChunk(s, prompt[: s + 1], 0, 0) for s in range(4)])
        order = [1, 2, 3, 0]
        chunks = [DecodeChunk(s, [5 + s, 6], s + 1, 2 if s % 2 else 1) for s in order]
        assert rt.call_rows([2] * 4, order) == [8]
        assert rt.call_rows([2] * 4, [0, 2, 3, 5]) == [2, 4, 2]
        got = rt.decode(chunks)
        mixed = [got[i].copy() for i in range(4)]
        for s in range(4):
            rt.truncate(s, s + 1)
        sorted_chunks = sorted(chunks, key=lambda c: c.seq_id)
        again = rt.decode(sorted_chunks)
        for i, seq in enumerate(order):
            assert np.array_equal(mixed[i], again[sorted(order).index(seq)])
    finally:
        rt.close()
