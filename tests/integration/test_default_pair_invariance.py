"""The real target in exact mode: batch-invariant kernels, proved row by row (marked ``model``).

The same sweep as ``tests/backends/test_batch_invariance.py`` on the 1.5B Q4_K_M target, whose 169 repacked
Q4_K and 29 Q6_K tensors are what the patch is for: every row of a 1…32-row call equals the one-token decode
of the same position, bit for bit, at a short and a longer KV depth.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from specserve.backends.base import DecodeChunk
from specserve.backends.invariance import check_tokens
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.models import CATALOG, DEFAULT_TARGET, ModelStore

pytestmark = pytest.mark.model
SIZES = [*range(1, 18), 24, 32]


@pytest.fixture(scope="module")
def target() -> Iterator[LlamaCppRuntime]:
    path = ModelStore().locate(CATALOG[DEFAULT_TARGET])
    if path is None:
        pytest.skip("default target not pulled (run: specserve models pull)")
    runtime = LlamaCppRuntime(path, context_per_sequence=1024, n_threads=2)
    yield runtime
    runtime.close()


def test_the_target_loads_batch_invariant(target: LlamaCppRuntime) -> None:
    assert target.info.exactness == "batch-invariant", target.info.exactness_note
    assert target.info.max_verify_tokens >= 32


@pytest.mark.parametrize("depth", [40, 520])
def test_every_row_equals_one_token_decoding(target: LlamaCppRuntime, depth: int) -> None:
    tokens = check_tokens(target, depth + max(SIZES))
    context, probe = tokens[:depth], tokens[depth:]
    target.free(0)
    target.decode([DecodeChunk(0, context, 0, 0)])
    plain = np.stack(
        [target.decode([DecodeChunk(0, [t], depth + i, 1)])[0][0].copy() for i, t in enumerate(probe)]
    )
    for n in SIZES:
        target.truncate(0, depth)
        batched = target.decode([DecodeChunk(0, probe[:n], depth, n)])[0]
        worst = float(np.max(np.abs(batched - plain[:n])))
        assert worst == 0.0, f"{n}-row call differs from one-token decoding by up to {worst}"
    target.free(0)
