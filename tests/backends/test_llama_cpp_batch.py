"""The batch a llama.cpp call reads: tokens in sequence order, their positions, the rows that want logits,
and each row's sequence id, also where a later call reuses rows that held another sequence."""

from __future__ import annotations

from specserve.backends.base import DecodeChunk
from specserve.backends.llama_cpp_batch import LlamaBatch
from specserve.backends.llama_cpp_lib import llama_lib


def _read(batch: LlamaBatch) -> list[tuple[int, int, int, int]]:
    raw = batch.batch
    return [(raw.token[j], raw.pos[j], raw.seq_id[j][0], raw.logits[j]) for j in range(raw.n_tokens)]


def test_a_call_is_written_in_sequence_order_with_its_logit_rows() -> None:
    batch = LlamaBatch(llama_lib(), 16)
    try:
        order = batch.fill([DecodeChunk(2, [7, 8, 9], 5, 2), DecodeChunk(0, [3], 10, 1)])
        assert order == [1, 0]
        assert _read(batch) == [(3, 10, 0, 1), (7, 5, 2, 0), (8, 6, 2, 1), (9, 7, 2, 1)]
        # the next call reuses the rows: sequence ids that changed are rewritten, a prompt wants no logits
        assert batch.fill([DecodeChunk(1, [4, 5], 0, 0), DecodeChunk(3, [6], 2, 1)]) is None
        assert _read(batch) == [(4, 0, 1, 0), (5, 1, 1, 0), (6, 2, 3, 1)]
    finally:
        batch.free()
