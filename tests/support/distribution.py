"""The exact distribution of a target's first two sampled tokens, and a check that samples follow it
(chi-square and total variation), shared by the engine's and the drafters' sampled losslessness tests."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from scipy.stats import chisquare

from specserve.backends.base import DecodeChunk, ModelRuntime, to_host
from specserve.verify import filter_logits_to_probs


def exact_pairs(
    target: ModelRuntime[Any], slot: int, prompt: list[int], knobs: dict[str, Any]
) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the target with the sampling knobs applied, from its own logits (``slot``, then freed)."""
    probs: dict[tuple[int, int], float] = {}
    first = target.decode([DecodeChunk(slot, prompt, 0, 1)])
    p1 = filter_logits_to_probs(to_host(first[0]), **knobs)[0]
    for t1 in np.nonzero(p1)[0]:
        target.truncate(slot, len(prompt))
        second = target.decode([DecodeChunk(slot, [int(t1)], len(prompt), 1)])
        p2 = filter_logits_to_probs(to_host(second[0]), **knobs)[0]
        for t2 in np.nonzero(p2)[0]:
            probs[(int(t1), int(t2))] = float(p1[t1] * p2[t2])
    target.free(slot)
    return probs


def assert_follows(
    counts: Counter[tuple[int, int]], expected: dict[tuple[int, int], float], n: int, max_tv: float
) -> None:
    """``counts`` of ``n`` samples come from ``expected``: no impossible pair, chi-square p > 1e-3 (cells
    under 5 expected pooled), total variation under ``max_tv``."""
    assert set(counts) <= set(expected)
    cells = sorted(expected)
    observed = np.array([counts.get(c, 0) for c in cells], dtype=np.float64)
    wanted = np.array([expected[c] for c in cells]) * n
    keep = wanted >= 5  # chi-square needs expected counts of at least 5; the rest pooled
    observed = np.append(observed[keep], observed[~keep].sum())
    wanted = np.append(wanted[keep], wanted[~keep].sum())
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    wanted *= observed.sum() / wanted.sum()
    assert chisquare(observed, wanted).pvalue > 1e-3
    assert 0.5 * np.abs(observed - wanted).sum() / n < max_tv


def sampled_pairs(engine: Any, prompt: list[int], n: int, knobs: dict[str, Any]) -> Counter[tuple[int, int]]:
    """The first two tokens of ``n`` seeded requests of ``prompt`` through ``engine`` (three tokens each, so
    the second can come from a draft the step after the first)."""
    from specserve.request import SamplingParams

    for seed in range(n):
        engine.add_request(f"s{seed}", prompt, SamplingParams(max_tokens=3, seed=seed, **knobs))
    produced: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
    return Counter((tokens[0], tokens[1]) for tokens in produced.values())
