"""Logit adjustments (grammar mask, logit_bias, repetition / frequency / presence penalties): the pure
function against a token-by-token reference of vLLM's semantics, host against device, and losslessness —
speculative output under an adjustment follows the adjusted target distribution, the second token's
penalties counting the first (a draft accepted before it)."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.request import SamplingParams
from specserve.verify import VerifyRequest, filter_logits_to_probs
from specserve.verify.adjust import adjust_logits, allowed_tokens, build_adjustment
from specserve.verify.host import HostVerifier

from .test_rejection_statistics import assert_follows

KNOBS = SamplingParams(
    temperature=0.9,
    top_k=6,
    presence_penalty=0.8,
    frequency_penalty=0.6,
    repetition_penalty=1.4,
    logit_bias=((2, 1.5), (5, -2.0)),
)


def bitmask(allowed: np.ndarray) -> np.ndarray:  # [rows, vocab] bool -> [rows, words] int32
    rows, vocab = allowed.shape
    padded = np.zeros((rows, ((vocab + 31) // 32) * 32), dtype=np.bool_)
    padded[:, :vocab] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view(np.int32)


def reference(logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """One row, token by token, as vLLM describes it."""
    out = logits.astype(np.float64).copy()
    for token, bias in params.logit_bias:
        out[token] += bias
    for token in range(out.size):
        if params.repetition_penalty != 1.0 and (token in prompt or token in output):
            r = params.repetition_penalty
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        count = output.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_adjustment_equals_the_reference_row_by_row(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = 40
    prompt = list(rng.integers(0, vocab, 12))
    output = list(rng.integers(0, vocab, 9))
    drafts = list(rng.integers(0, vocab, 4))
    allowed = rng.random((5, vocab)) < 0.7
    logits = rng.normal(size=(5, vocab)).astype(np.float32) * 3
    adjustment = build_adjustment(KNOBS, prompt, output, drafts, bitmask(allowed))
    assert adjustment is not None
    adjusted = logits.copy()
    adjust_logits(adjusted, adjustment)
    for j in range(5):
        expected = reference(logits[j], KNOBS, prompt, output + drafts[:j])
        expected[~allowed[j]] = -np.inf
        np.testing.assert_allclose(adjusted[j], expected, rtol=1e-5, atol=1e-5)
    assert np.array_equal(allowed_tokens(bitmask(allowed), vocab), allowed)


def test_no_knob_means_no_adjustment() -> None:
    assert build_adjustment(SamplingParams(), [1, 2], [3], [4, 5]) is None


def test_device_adjustment_equals_the_host() -> None:
    torch = pytest.importorskip("torch")
    from specserve.verify.device_adjust import adjust_rows

    rng = np.random.default_rng(3)
    for _ in range(20):
        vocab = int(rng.integers(2, 300))
        k = int(rng.integers(0, 5))
        logits = (rng.normal(size=(k + 1, vocab)) * 3).astype(np.float32)
        params = SamplingParams(
            frequency_penalty=float(rng.uniform(-2, 2)),
            presence_penalty=float(rng.uniform(-2, 2)),
            repetition_penalty=float(rng.uniform(0.5, 3)),
            logit_bias=((int(rng.integers(0, vocab)), float(rng.uniform(-100, 100))),),
        )
        allowed = rng.random((k + 1, vocab)) < 0.8
        allowed[:, 0] = True
        adjustment = build_adjustment(
            params, list(rng.integers(0, vocab, 7)), list(rng.integers(0, vocab, 5)),
            list(rng.integers(0, vocab, k)), bitmask(allowed),
        )  # fmt: skip
        assert adjustment is not None
        host = logits.copy()
        adjust_logits(host, adjustment)
        device = torch.from_numpy(logits.copy())
        adjust_rows(device, adjustment)
        np.testing.assert_array_equal(device.numpy(), host)


@pytest.mark.parametrize("drafts", ["draft_model", "one_hot"])
def test_speculation_under_an_adjustment_is_lossless(drafts: str) -> None:
    """The first two emitted tokens follow the adjusted target exactly (chi-square and TV), whatever the
    drafter proposes, with a grammar-like mask that forbids some tokens after others."""
    rng = np.random.default_rng(2026)
    vocab, k, trials = 8, 3, 8_000
    target_logits = (rng.standard_normal((vocab, vocab)) * 1.2).astype(np.float32)  # [prev, next]
    draft_logits = target_logits + rng.standard_normal((vocab, vocab)).astype(np.float32)
    allowed_after = rng.random((vocab, vocab)) < 0.7  # the "grammar": allowed[prev, next]
    allowed_after[:, 0] = True
    prompt, context = [3, 3, 1], 4

    def target_probs(prev: int, output: list[int]) -> np.ndarray:
        masks = bitmask(allowed_after[prev][None])
        adjustment = build_adjustment(KNOBS, prompt, output, [], masks)
        assert adjustment is not None
        row = target_logits[prev][None].copy()
        adjust_logits(row, adjustment)
        probs: np.ndarray = filter_logits_to_probs(row, KNOBS.temperature, KNOBS.top_k)[0]
        return probs

    draft_chain = filter_logits_to_probs(draft_logits, KNOBS.temperature, KNOBS.top_k)  # [prev, next]
    cumulative = np.cumsum(draft_chain, axis=1)

    def step(output: list[int], prev: int) -> list[int]:
        chain = [prev]
        for u in rng.random(k):
            chain.append(min(int(np.searchsorted(cumulative[chain[-1]], u, side="right")), vocab - 1))
        draft_probs = [draft_chain[t] for t in chain[:k]]
        draft_ids = chain[1:]
        rows = np.stack([target_logits[t] for t in chain])
        masks = bitmask(np.stack([allowed_after[t] for t in chain]))
        adjustment = build_adjustment(KNOBS, prompt, output, draft_ids, masks)
        request = VerifyRequest(
            draft_ids, KNOBS, np.stack(draft_probs) if drafts == "draft_model" else None,
            rng.random(k), rng.random(k + 1), adjustment,
        )  # fmt: skip
        return HostVerifier().verify(rows, [request])[0]

    first, second = np.empty(trials, np.int64), np.empty(trials, np.int64)
    for t in range(trials):
        emitted = step([], context)
        if len(emitted) == 1:
            emitted += step(emitted, emitted[0])[:1]
        first[t], second[t] = emitted[0], emitted[1]
    p_first = target_probs(context, [])
    assert_follows(first, p_first, max_tv=0.03)
    pair = np.stack([p_first[a] * target_probs(a, [a]) for a in range(vocab)])
    assert_follows(first * vocab + second, pair.ravel(), max_tv=0.05)
