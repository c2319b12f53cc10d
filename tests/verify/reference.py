"""Naive oracles for specserve.verify: one position at a time, plain Python, written from the definitions.

They share no code with the vectorized implementations; tests check that both give the same answers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

# The spec's slack for "cumulative mass reaches top_p" (see specserve.verify.sampling.TOP_P_TOLERANCE).
TOP_P_TOLERANCE = 1e-9


def filter_row_ref(
    logits: Sequence[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """Temperature, softmax, top-k, top-p (on the top-k-kept mass), min-p, renormalize; ties: lowest id."""
    scaled = [float(x) / temperature for x in logits]
    highest = max(scaled)
    weights = [math.exp(x - highest) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    vocab = len(probs)

    by_rank = sorted(range(vocab), key=lambda t: (-probs[t], t))  # most probable first, ties by lower id
    kept = by_rank[:top_k] if 0 < top_k < vocab else by_rank
    if top_p < 1.0:
        kept_mass = sum(probs[t] for t in kept)
        nucleus: list[int] = []
        mass = 0.0
        for t in kept:
            nucleus.append(t)
            mass += probs[t]
            if mass >= top_p * kept_mass * (1.0 - TOP_P_TOLERANCE):
                break
        kept = nucleus
    if min_p > 0.0:
        most_probable = max(probs)
        kept = [t for t in kept if probs[t] >= min_p * most_probable]

    kept_total = sum(probs[t] for t in kept)
    result = [0.0] * vocab
    for t in kept:
        result[t] = probs[t] / kept_total
    return result


def filter_logits_to_probs_ref(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> np.ndarray:
    return np.array([filter_row_ref(row.tolist(), temperature, top_k, top_p, min_p) for row in logits])


def inverse_cdf_ref(probs: Sequence[float], u: float) -> int:
    """First token whose running total exceeds u * total; the last nonzero token if rounding runs past."""
    probs = [float(x) for x in probs]
    total = 0.0
    for x in probs:
        total += x
    threshold = u * total
    running = 0.0
    for token, x in enumerate(probs):
        running += x
        if running > threshold:
            return token
    return max(t for t, x in enumerate(probs) if x > 0)


def argmax_ref(values: Sequence[float]) -> int:
    best = 0
    for t in range(1, len(values)):
        if values[t] > values[best]:
            best = t
    return best


def verify_greedy_ref(
    draft_token_ids: np.ndarray, num_draft_tokens: np.ndarray, target_logits: np.ndarray
) -> list[list[int]]:
    """The tokens each row emits: drafts while they equal the target's argmax, then the target's argmax."""
    emitted = []
    for b in range(draft_token_ids.shape[0]):
        tokens = []
        for j in range(int(num_draft_tokens[b]) + 1):
            choice = argmax_ref(target_logits[b, j].tolist())
            tokens.append(choice)
            if j == num_draft_tokens[b] or draft_token_ids[b, j] != choice:
                break
        emitted.append(tokens)
    return emitted


def verify_rejection_ref(
    draft_token_ids: np.ndarray,
    num_draft_tokens: np.ndarray,
    target_probs: np.ndarray,
    draft_probs: np.ndarray | None,
    accept_uniforms: np.ndarray | None,
    sample_uniforms: np.ndarray,
) -> list[list[int]]:
    """Leviathan et al.'s loop, one row and one position at a time; draft_probs None: one-hot drafts."""
    emitted = []
    for b in range(draft_token_ids.shape[0]):
        num_drafts = int(num_draft_tokens[b])
        tokens: list[int] = []
        for j in range(num_drafts):
            draft = int(draft_token_ids[b, j])
            target_row = target_probs[b, j].tolist()
            if draft_probs is None:
                target_sample = inverse_cdf_ref(target_row, float(sample_uniforms[b, j]))
                tokens.append(target_sample)
                if target_sample != draft:
                    break
                continue
            assert accept_uniforms is not None
            draft_row = draft_probs[b, j].tolist()
            if accept_uniforms[b, j] * draft_row[draft] < target_row[draft]:
                tokens.append(draft)
                continue
            residual = [max(t - d, 0.0) for t, d in zip(target_row, draft_row, strict=True)]
            residual_mass = sum(residual)
            distribution = [r / residual_mass for r in residual] if residual_mass > 0 else target_row
            tokens.append(inverse_cdf_ref(distribution, float(sample_uniforms[b, j])))
            break
        else:
            bonus = inverse_cdf_ref(
                target_probs[b, num_drafts].tolist(), float(sample_uniforms[b, num_drafts])
            )
            tokens.append(bonus)
        emitted.append(tokens)
    return emitted
