"""Logits → filtered probabilities, and position-coupled inverse-CDF sampling.

The target's distribution at an output position is ``filter_logits_to_probs(logits, ...)``: temperature,
softmax, then top-k, top-p and min-p, each acting on what the previous one kept, then renormalization. A token
is drawn from it with :func:`sample_inverse_cdf` and the position's uniform number, so the same uniform gives
the same token whether the position is reached by plain decoding or by verifying a draft (see request.py).
Greedy decoding never builds probabilities: it takes :func:`greedy_argmax` of the raw logits.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

from specserve.request import SamplingParams

TOP_P_TOLERANCE = 1e-9
"""Cumulative mass within this of ``top_p`` (relative) counts as reaching it, so rounding in the running sum
cannot pull one more token into the nucleus when the mass lands exactly on ``top_p``."""


def filter_logits_to_probs(
    logits: npt.NDArray[np.floating[Any]],  # [n, vocab] float32
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> npt.NDArray[np.float64]:  # [n, vocab] float64, each row sums to 1
    """The filtered sampling distribution of each row of ``logits``.

    Steps, in order: divide by ``temperature`` (> 0); softmax; top-k keeps the ``top_k`` most probable tokens
    (0 or >= vocab disables; ties at the boundary keep the lowest ids, so exactly ``top_k`` survive); top-p
    keeps the smallest most-probable-first prefix whose mass reaches ``top_p`` of the mass top-k kept (ties
    ordered by lowest id; the top token always stays); min-p drops tokens below ``min_p`` times the row's
    most probable token; renormalize. Logits may be ``-inf`` (banned tokens) but each row needs a finite one.

    After top-k the later filters work on the ``top_k`` candidates only; without it, top-p sorts the
    probability values of the whole vocabulary once.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 to build probabilities, got {temperature}")
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {logits.shape}")
    vocab = logits.shape[1]
    # Shift before dividing: a tiny temperature then sends every non-maximal logit to -inf instead of
    # overflowing the maximum itself to inf (inf - inf is NaN; 5e-324 once took the engine down).
    shifted = logits.astype(np.float64)
    shifted -= shifted.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):  # -inf is the intended result of an overflow here
        probs = _softmax(np.divide(shifted, temperature, out=shifted))
    candidate_ids: npt.NDArray[np.int64] | None = None  # [n, m] ascending ids; None: the whole vocabulary
    candidate_probs = probs  # [n, m] float64
    if 0 < top_k < vocab:
        candidate_ids = _top_k_ids(probs, top_k)
        candidate_probs = np.take_along_axis(probs, candidate_ids, axis=-1)
    keep = np.ones(candidate_probs.shape, dtype=np.bool_)  # [n, m] bool
    if top_p < 1.0:
        keep &= _nucleus_mask(candidate_probs, top_p * candidate_probs.sum(axis=-1, keepdims=True))
    if min_p > 0.0:
        keep &= candidate_probs >= min_p * candidate_probs.max(axis=-1, keepdims=True)
    kept = candidate_probs * keep
    kept /= kept.sum(axis=-1, keepdims=True)
    if candidate_ids is None:
        return kept
    filtered = np.zeros(probs.shape, dtype=np.float64)
    np.put_along_axis(filtered, candidate_ids, kept, axis=-1)
    return filtered


def probs_from_params(
    logits: npt.NDArray[np.floating[Any]],  # [n, vocab] float32
    params: SamplingParams,
) -> npt.NDArray[np.float64]:  # [n, vocab] float64
    """:func:`filter_logits_to_probs` with a request's sampling parameters; not for greedy requests."""
    if params.greedy:
        raise ValueError("greedy requests take greedy_argmax of the logits, not probabilities")
    return filter_logits_to_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)


def sample_inverse_cdf(
    probs: npt.NDArray[np.float64],  # [n, vocab] float64, rows >= 0 with a positive sum (need not be 1)
    uniforms: npt.NDArray[np.float64],  # [n] float64 in [0, 1)
) -> npt.NDArray[np.int64]:  # [n] int64
    """Per row, the smallest token id whose cumulative probability (in id order) exceeds ``u * row_sum``.

    Example: probs ``[0.25, 0.25, 0.5]`` give token 0 for u in [0, 0.25), 1 for [0.25, 0.5), 2 for [0.5, 1).
    ``row_sum`` is the last entry of the same running sum, so unnormalized rows (residuals) need no division.
    A zero-probability token is never returned: should rounding leave ``u * row_sum`` at or past the end of
    the running sum, the last token with nonzero probability is returned instead.
    """
    if probs.ndim != 2 or uniforms.shape != (probs.shape[0],):
        raise ValueError(f"probs must be [n, vocab] and uniforms [n], got {probs.shape} and {uniforms.shape}")
    cumulative = np.cumsum(probs, axis=-1)
    row_sums = cumulative[:, -1]
    if np.any(~(row_sums > 0)):
        raise ValueError("every row of probs needs a positive sum")
    thresholds = (uniforms * row_sums)[:, None]
    token_ids: npt.NDArray[np.int64] = np.count_nonzero(cumulative <= thresholds, axis=-1).astype(np.int64)
    overflow = np.flatnonzero(token_ids >= probs.shape[1])
    if overflow.size:
        vocab = probs.shape[1]
        last_nonzero = vocab - 1 - np.argmax(probs[overflow, ::-1] > 0, axis=-1)
        token_ids[overflow] = last_nonzero
    return token_ids


def greedy_argmax(
    logits: npt.NDArray[np.floating[Any]],  # [..., vocab] float32
) -> npt.NDArray[np.int64]:  # [...] int64
    """The most likely token along the last axis; ties go to the lowest id.

    Many rows (a batch of verify steps: 32 rows of Qwen's 151,936 are 19 MB to read) are split in two,
    the first half on a helper thread (numpy lets go of the GIL while it scans): 474 -> 261 us for 32 rows
    in cache, 1,101 -> 811 us fresh from memory, on a 2-core Zen 4. A row's result does not depend on
    the split."""
    if logits.ndim == 2 and logits.shape[0] >= PARALLEL_ARGMAX_ROWS:
        half = logits.shape[0] // 2
        first = _argmax_pool().submit(np.argmax, logits[:half], -1)
        rest = np.argmax(logits[half:], axis=-1)
        both: npt.NDArray[np.int64] = np.concatenate([first.result(), rest]).astype(np.int64)
        return both
    token_ids: npt.NDArray[np.int64] = np.argmax(logits, axis=-1).astype(np.int64)
    return token_ids


PARALLEL_ARGMAX_ROWS = 16
"""From this many rows the argmax is worth a second thread's wake-up (tens of microseconds here)."""


@functools.cache
def _argmax_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-argmax")


def _softmax(
    scaled: npt.NDArray[np.float64],  # [n, vocab] float64, modified in place
) -> npt.NDArray[np.float64]:  # [n, vocab] float64
    scaled -= scaled.max(axis=-1, keepdims=True)
    np.exp(scaled, out=scaled)
    scaled /= scaled.sum(axis=-1, keepdims=True)
    return scaled


def _top_k_ids(
    probs: npt.NDArray[np.float64],  # [n, vocab] float64
    top_k: int,  # 0 < top_k < vocab
) -> npt.NDArray[np.int64]:  # [n, top_k] int64, ascending ids
    """Ids of the ``top_k`` most probable tokens of each row; ties at the boundary keep the lowest ids.

    Example: probs ``[0.1, 0.3, 0.3, 0.3]`` with ``top_k = 2`` give ``[1, 2]``. A linear-time partition
    finds them; only when the k-th value is tied outside the partition are the tied slots refilled by id.
    """
    n, vocab = probs.shape
    kth_pos = vocab - top_k
    top_ids = np.argpartition(probs, kth_pos, axis=-1)[:, kth_pos:]  # the k largest, unordered
    kth_value = np.take_along_axis(probs, top_ids[:, :1], axis=-1)  # [n, 1], the k-th largest
    if np.all(np.count_nonzero(probs >= kth_value, axis=-1) == top_k):  # no tie straddles the boundary
        kept_ids: npt.NDArray[np.int64] = np.sort(top_ids, axis=-1).astype(np.int64)
        return kept_ids
    keep = _keep_largest(probs, kth_value, np.full((n, 1), top_k))
    kept_ids = np.nonzero(keep)[1].reshape(n, top_k).astype(np.int64)
    return kept_ids


def _nucleus_mask(
    candidate_probs: npt.NDArray[np.float64],  # [n, m] float64, in ascending id order
    target_mass: npt.NDArray[np.float64],  # [n, 1] float64
) -> npt.NDArray[np.bool_]:  # [n, m] bool
    """The smallest most-probable-first prefix of the candidates whose mass reaches ``target_mass``.

    Example: candidate probs ``[0.1, 0.4, 0.2, 0.3]`` and target mass 0.6 give ``[F, T, F, T]``. Only the
    values are sorted (an index sort of 150k entries is several times slower): the running sum of the sorted
    values fixes the nucleus size and its smallest value, and ties at that value are kept lowest id first.
    """
    descending = np.sort(candidate_probs, axis=-1)[:, ::-1]
    cumulative = np.cumsum(descending, axis=-1)
    reached = cumulative >= target_mass * (1.0 - TOP_P_TOLERANCE)
    last = np.argmax(reached, axis=-1)[:, None]  # the last entry always reaches, as top_p <= 1
    nucleus_size = last + 1
    smallest_kept = np.take_along_axis(descending, last, axis=-1)  # [n, 1]
    mask = candidate_probs >= smallest_kept
    if np.all(np.count_nonzero(mask, axis=-1, keepdims=True) == nucleus_size):
        return mask
    return _keep_largest(candidate_probs, smallest_kept, nucleus_size)


def _keep_largest(
    values: npt.NDArray[np.float64],  # [n, m] float64
    boundary: npt.NDArray[np.float64],  # [n, 1] float64, the count-th largest value of the row
    count: npt.NDArray[np.int64],  # [n, 1] int64
) -> npt.NDArray[np.bool_]:  # [n, m] bool, exactly count True per row
    """Keep the ``count`` largest values; among values equal to ``boundary`` the lowest indices win.

    Example: values ``[0.3, 0.1, 0.3, 0.3]``, boundary 0.3, count 2 give ``[T, F, T, F]``.
    """
    above = values > boundary
    tied = values == boundary
    slots_for_ties = count - np.count_nonzero(above, axis=-1, keepdims=True)
    keep: npt.NDArray[np.bool_] = above | (tied & (np.cumsum(tied, axis=-1) <= slots_for_ties))
    return keep
