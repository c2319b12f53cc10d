"""Lossless rejection sampling of drafts (Leviathan et al. 2023; Chen et al. 2023).

Names follow the roles, not the papers' letters: ``target_probs`` is the target model's filtered
distribution (the paper's p), ``draft_probs`` the drafter's (the paper's q). Draft ``x_j`` at position ``j``
is *accepted* with probability ``min(1, target_probs[j, x_j] / draft_probs[j, x_j])``; the first rejection
ends the run and the row emits the *recovered token*, drawn from the residual
``norm(max(target_probs[j] - draft_probs[j], 0))``. When every draft is accepted the row emits the *bonus
token*, drawn from ``target_probs`` after the last draft. Each emitted token is then distributed exactly as
the target's, whatever the drafter proposes.

Model-free drafters (n-gram, prompt lookup) propose tokens without a distribution, which is a one-hot
``draft_probs``. Leviathan's test then accepts ``x`` with probability ``target_probs[x]``, and the residual
``norm(max(target_probs - onehot(x), 0))`` is ``target_probs`` with ``x`` removed, renormalized. Drawing the
target's own token ``t = inverse_cdf(target_probs, u)`` and accepting ``x`` iff ``t == x`` is that same
test: ``t == x`` has probability ``target_probs[x]``, and given ``t != x``, ``t`` follows ``target_probs``
with ``x`` removed, renormalized, so emitting ``t`` as the recovered token is exact. It also means the token
emitted at a position is the token plain decoding draws there with the same uniform: with position-coupled
uniforms (request.py), sampled output does not depend on the drafts or the draft length.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from specserve.verify.sampling import sample_inverse_cdf
from specserve.verify.types import PLACEHOLDER_TOKEN_ID, VerifyResult, draft_positions_mask, first_false


def verify_rejection(
    draft_token_ids: npt.NDArray[np.int64],  # [batch, max_k] int64, PLACEHOLDER_TOKEN_ID-padded
    num_draft_tokens: npt.NDArray[np.int64],  # [batch] int64, each in [0, max_k]
    target_probs: npt.NDArray[np.float64],  # [batch, max_k + 1, vocab] float64, filtered, rows sum to 1
    draft_probs: npt.NDArray[np.float64] | None,  # [batch, max_k, vocab] float64, or None: one-hot drafts
    accept_uniforms: npt.NDArray[np.float64] | None,  # [batch, max_k] float64 in [0, 1); None if one-hot
    sample_uniforms: npt.NDArray[np.float64],  # [batch, max_k + 1] float64 in [0, 1)
) -> VerifyResult:
    """Verify a padded batch of drafts by rejection sampling against the target's distributions.

    ``target_probs[b, j]`` is the target's distribution after the context plus the first ``j`` drafts of row
    ``b`` (positions past ``num_draft_tokens[b]`` are padding). ``sample_uniforms[b, j]`` draws the token the
    row emits at output position ``j`` (recovered or bonus); ``accept_uniforms[b, j]`` is the coin of draft
    ``j`` and is only used with ``draft_probs``. A row without drafts emits just its bonus token: a plain
    sampling step.

    Example (one-hot drafts ``[3, 1]``): if the target draws ``t = [3, 4, .]`` from its first two
    positions, draft 3 is accepted, draft 1 is rejected and the row emits ``[3, 4]`` (recovered token 4).
    """
    vocab = target_probs.shape[-1]
    is_draft = draft_positions_mask(draft_token_ids, num_draft_tokens, vocab)
    batch, max_k = draft_token_ids.shape
    _check_shape("target_probs", target_probs.shape, (batch, max_k + 1, vocab))
    _check_shape("sample_uniforms", sample_uniforms.shape, (batch, max_k + 1))
    if draft_probs is None:
        return _verify_one_hot(draft_token_ids, num_draft_tokens, target_probs, sample_uniforms)
    if accept_uniforms is None:
        raise ValueError("accept_uniforms are required with draft_probs")
    _check_shape("draft_probs", draft_probs.shape, (batch, max_k, vocab))
    _check_shape("accept_uniforms", accept_uniforms.shape, (batch, max_k))

    # The accept test u < target/draft, written without division: always true when target >= draft.
    gather_ids = np.where(is_draft, draft_token_ids, 0)[:, :, None]  # [batch, max_k, 1]; padding reads id 0
    target_at_draft = np.take_along_axis(target_probs[:, :max_k], gather_ids, axis=-1)[:, :, 0]
    draft_at_draft = np.take_along_axis(draft_probs, gather_ids, axis=-1)[:, :, 0]
    accepted = is_draft & (accept_uniforms * draft_at_draft < target_at_draft)
    num_accepted = first_false(accepted)  # [batch] int64

    # Each row samples once, at its stopping position: the residual if a draft was rejected there,
    # the target's own distribution for the bonus token.
    rows = np.arange(batch)
    final_dists = target_probs[rows, num_accepted]  # [batch, vocab] float64 (a copy)
    rejected_rows = np.flatnonzero(num_accepted < num_draft_tokens)
    if rejected_rows.size:
        residuals = np.maximum(
            final_dists[rejected_rows] - draft_probs[rejected_rows, num_accepted[rejected_rows]], 0.0
        )
        usable = residuals.sum(axis=-1) > 0  # an all-zero residual can only come from rounding
        final_dists[rejected_rows[usable]] = residuals[usable]
    final_tokens = sample_inverse_cdf(final_dists, sample_uniforms[rows, num_accepted])

    output_token_ids = np.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    is_accepted = np.arange(max_k)[None, :] < num_accepted[:, None]
    output_token_ids[:, :max_k] = np.where(is_accepted, draft_token_ids, PLACEHOLDER_TOKEN_ID)
    output_token_ids[rows, num_accepted] = final_tokens
    return VerifyResult(output_token_ids=output_token_ids, num_accepted=num_accepted)


def _verify_one_hot(
    draft_token_ids: npt.NDArray[np.int64],  # [batch, max_k] int64
    num_draft_tokens: npt.NDArray[np.int64],  # [batch] int64
    target_probs: npt.NDArray[np.float64],  # [batch, max_k + 1, vocab] float64
    sample_uniforms: npt.NDArray[np.float64],  # [batch, max_k + 1] float64
) -> VerifyResult:
    """Model-free drafts: the target samples position by position; a draft survives iff it was drawn.

    Only rows still running sample at each position, so a row costs one inverse CDF per emitted token.
    """
    batch, max_k = draft_token_ids.shape
    output_token_ids = np.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    num_accepted = np.zeros(batch, dtype=np.int64)
    # A placeholder column after the drafts never matches a sample, so every row stops by position max_k.
    drafts_or_end = np.concatenate(
        [draft_token_ids, np.full((batch, 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)], axis=1
    )
    running = np.arange(batch)  # rows whose drafts so far were all accepted
    for position in range(max_k + 1):
        if running.size == 0:
            break
        sampled = sample_inverse_cdf(target_probs[running, position], sample_uniforms[running, position])
        output_token_ids[running, position] = sampled
        # Stop at the bonus position (no draft left) or at a rejected draft (sampled is the recovered token).
        stops = (num_draft_tokens[running] == position) | (sampled != drafts_or_end[running, position])
        num_accepted[running[stops]] = position
        running = running[~stops]
    return VerifyResult(output_token_ids=output_token_ids, num_accepted=num_accepted)


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if shape != expected:
        raise ValueError(f"{name} must have shape {list(expected)}, got {list(shape)}")
