"""Logprobs of emitted tokens: log-softmax of the raw rows, top alternatives most likely first (ties: lowest
id), the same numbers (to 1e-6: the host sums exponentials of float32 logits) from numpy and from a tensor."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.verify.logprobs import token_logprobs


def test_logprobs_are_the_log_softmax_of_each_row() -> None:
    rows = np.array([[0.0, 1.0, 1.0, -np.inf], [2.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    entries = token_logprobs(rows, [2, 3], 3)
    expected = np.log(np.exp([0.0, 1.0, 1.0]) / np.exp([0.0, 1.0, 1.0]).sum())
    assert entries[0].token_id == 2 and entries[0].logprob == pytest.approx(expected[2])
    assert [t for t, _ in entries[0].top] == [1, 2, 0]  # the tie 1/2 goes to the lower id first
    assert entries[1].top[0][0] == 0 and entries[1].top[1][0] == 1
    assert all(lp <= 0 for e in entries for _, lp in e.top)
    assert token_logprobs(rows, [], 2) == []


def test_device_logprobs_equal_the_host() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    rows = (rng.normal(size=(6, 500)) * 4).astype(np.float32)
    tokens = [int(t) for t in rng.integers(0, 500, 6)]
    host = token_logprobs(rows, tokens, 5)
    device = token_logprobs(torch.from_numpy(rows), tokens, 5)
    for h, d in zip(host, device, strict=True):
        assert h.token_id == d.token_id and h.logprob == pytest.approx(d.logprob, abs=1e-6)
        assert [t for t, _ in h.top] == [t for t, _ in d.top]
        assert np.allclose([v for _, v in h.top], [v for _, v in d.top], atol=1e-6)


def test_a_steps_logprobs_in_one_call_equal_each_requests_alone() -> None:
    """Several requests of one step, each with its own rows and top_n (0 included), through one device call
    (one upload, one read): what each gets alone from the host."""
    torch = pytest.importorskip("torch")
    from specserve.verify.logprobs import step_token_logprobs

    rng = np.random.default_rng(1)
    rows = (rng.normal(size=(9, 400)) * 3).astype(np.float32)
    requests = [(0, [5, 7], 2), (2, [11], 0), (3, [1, 2, 3, 4], 6), (7, [399, 0], 1)]
    batched = step_token_logprobs(torch.from_numpy(rows), requests)
    for (first, ids, top_n), got in zip(requests, batched, strict=True):
        alone = token_logprobs(rows[first : first + len(ids)], ids, top_n)
        assert [e.token_id for e in got] == ids and [len(e.top) for e in got] == [top_n] * len(ids)
        for h, d in zip(alone, got, strict=True):
            assert h.logprob == pytest.approx(d.logprob, abs=1e-6)
            assert [t for t, _ in h.top] == [t for t, _ in d.top]
