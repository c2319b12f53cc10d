"""The runtime interface's own pieces: a step's logits in one array with chunk offsets; default packing."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.backends.base import StepLogits, one_call, row_offsets


def test_step_logits_are_one_array_sliced_by_chunk() -> None:
    rows = np.arange(5 * 3, dtype=np.float32).reshape(5, 3)
    logits = StepLogits(rows, row_offsets([0, 4, 1]))
    assert logits.offsets == (0, 0, 4, 5) and len(logits) == 3
    assert logits[0].shape == (0, 3)
    assert np.array_equal(logits[1], rows[:4]) and np.array_equal(logits[2], rows[4:])
    assert [chunk.shape[0] for chunk in logits] == [0, 4, 1]
    first, _, last = logits  # unpacks like the list of arrays it replaces
    assert first.size == 0 and np.shares_memory(last, rows)  # views, no copies
    with pytest.raises(IndexError):
        logits[3]


def test_one_call_packing() -> None:
    assert one_call([3, 1, 1]) == [5]
    assert one_call([]) == []
