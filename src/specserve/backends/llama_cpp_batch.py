"""The ``llama_batch`` one llama.cpp runtime fills for each ``llama_decode`` call.

A call's tokens go in sequence order: llama.cpp splits a call into one pass per run of consecutive sequence
ids (llama_cpp_passes.py), so sequences 1, 2, 3, 0 in that order would cost two passes. The batch is
filled with one numpy assignment per field (tokens, positions, which rows want logits) from Python lists,
and a row's sequence id is written through ctypes only where it changed since the last call: at one
stream a plain step is one token, and a fill of several numpy calls and a ctypes write per token cost
about 5 us of a tiny model's step (AMD EPYC Zen 4; docs/BENCHMARKS.md, the host path on Zen 4 again).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from specserve.backends.base import DecodeChunk


class LlamaBatch:
    """A ``llama_batch`` of ``capacity`` tokens, one sequence id per token, and what was last written."""

    def __init__(self, lib: Any, capacity: int) -> None:
        self._lib = lib
        self.batch = lib.llama_batch_init(capacity, 0, 1)
        self._tokens = np.ctypeslib.as_array(self.batch.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(capacity,))
        self._want_logits = np.ctypeslib.as_array(self.batch.logits, shape=(capacity,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(capacity,))[:] = 1
        self._seq_ids = [-1] * capacity  # what each row's seq_id[0] holds (llama_batch_init leaves garbage)

    def fill(self, chunks: Sequence[DecodeChunk]) -> list[int] | None:
        """Write ``chunks`` in sequence order; the order taken (chunk indices), or None where it is theirs."""
        order = None
        if any(chunks[j].seq_id > chunks[j + 1].seq_id for j in range(len(chunks) - 1)):
            order = sorted(range(len(chunks)), key=lambda j: chunks[j].seq_id)
            chunks = [chunks[j] for j in order]
        tokens: list[int] = []
        positions: list[int] = []
        want: list[int] = []
        seq_ids: list[int] = []
        for c in chunks:
            n = len(c.tokens)
            tokens += c.tokens
            positions += range(c.start_pos, c.start_pos + n)
            want += [0] * (n - c.num_logits)
            want += [1] * c.num_logits
            seq_ids += [c.seq_id] * n
        count = len(tokens)
        self._tokens[:count] = tokens
        self._pos[:count] = positions
        self._want_logits[:count] = want
        written, rows = self._seq_ids, self.batch.seq_id
        for j, seq_id in enumerate(seq_ids):
            if written[j] != seq_id:
                rows[j][0] = written[j] = seq_id
        self.batch.n_tokens = count
        return order

    def free(self) -> None:
        self._lib.llama_batch_free(self.batch)
