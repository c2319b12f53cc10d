"""The verifiers' types (their result, a sequence's request, the verifier interface) and the padded-batch
conventions they share.

A batch of drafts is a padded array ``draft_token_ids [batch, max_k]``: row ``b`` holds
``num_draft_tokens[b]`` proposed tokens followed by :data:`PLACEHOLDER_TOKEN_ID`. Verification emits, per row,
the *accepted tokens* (the leading draft tokens the target keeps) followed by exactly one token from the
target: the *recovered token* at the first rejected position, or the *bonus token* after the last draft
position when every draft was accepted. The output is padded the same way to ``[batch, max_k + 1]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from specserve.request import SamplingParams
from specserve.verify.adjust import LogitAdjustment

LogitsT_contra = TypeVar("LogitsT_contra", contravariant=True)

PLACEHOLDER_TOKEN_ID: Final = -1
"""Pads draft and output token arrays beyond each row's length; never a real token id."""


@dataclass(frozen=True)
class VerifyResult:
    """What one verification step emits for each row of the batch."""

    output_token_ids: npt.NDArray[np.int64]  # [batch, max_k + 1] int64, PLACEHOLDER_TOKEN_ID-padded
    """Accepted tokens, then the recovered or bonus token: ``num_accepted[b] + 1`` real ids in row ``b``."""
    num_accepted: npt.NDArray[np.int64]  # [batch] int64
    """Accepted draft tokens per row, excluding the recovered/bonus token."""

    def __post_init__(self) -> None:
        batch = self.num_accepted.shape[0]
        if self.output_token_ids.ndim != 2 or self.output_token_ids.shape[0] != batch:
            raise ValueError(
                f"output_token_ids {self.output_token_ids.shape} does not match num_accepted {batch}"
            )
        if batch and (self.num_accepted.min() < 0 or self.num_accepted.max() >= self.max_positions):
            raise ValueError("num_accepted must lie in [0, max_k]")

    @property
    def max_positions(self) -> int:
        """``max_k + 1``: the width of :attr:`output_token_ids`."""
        return int(self.output_token_ids.shape[1])

    @property
    def num_emitted(self) -> npt.NDArray[np.int64]:  # [batch] int64
        """Tokens emitted per row: the accepted ones plus the recovered or bonus token."""
        return self.num_accepted + 1

    def tokens(self, b: int) -> list[int]:
        """The tokens row ``b`` emits, in order, without padding."""
        return [int(t) for t in self.output_token_ids[b, : int(self.num_accepted[b]) + 1]]


def draft_positions_mask(
    draft_token_ids: npt.NDArray[np.int64],  # [batch, max_k] int64, PLACEHOLDER_TOKEN_ID-padded
    num_draft_tokens: npt.NDArray[np.int64],  # [batch] int64
    vocab_size: int,
) -> npt.NDArray[np.bool_]:  # [batch, max_k] bool
    """Check a padded draft batch and return which positions hold real draft tokens.

    Example: ``draft_token_ids = [[5, 7, -1], [9, -1, -1]]`` and ``num_draft_tokens = [2, 1]`` give
    ``[[True, True, False], [True, False, False]]``. Raises ValueError on a bad shape, a length outside
    ``[0, max_k]`` or a real position whose id is not in ``[0, vocab_size)``.
    """
    if draft_token_ids.ndim != 2:
        raise ValueError(f"draft_token_ids must be [batch, max_k], got shape {draft_token_ids.shape}")
    batch, max_k = draft_token_ids.shape
    if num_draft_tokens.shape != (batch,):
        raise ValueError(f"num_draft_tokens must be [{batch}], got shape {num_draft_tokens.shape}")
    if batch and (num_draft_tokens.min() < 0 or num_draft_tokens.max() > max_k):
        raise ValueError(f"num_draft_tokens must lie in [0, {max_k}]")
    valid: npt.NDArray[np.bool_] = np.arange(max_k)[None, :] < num_draft_tokens[:, None]
    real_ids = draft_token_ids[valid]
    if real_ids.size and (real_ids.min() < 0 or real_ids.max() >= vocab_size):
        raise ValueError(f"draft token ids must lie in [0, {vocab_size}) within each row's length")
    return valid


def first_false(
    flags: npt.NDArray[np.bool_],  # [batch, width] bool
) -> npt.NDArray[np.int64]:  # [batch] int64 in [0, width]
    """Length of the leading run of True in each row (``width`` when the whole row is True).

    Example: ``[[True, True, False, True], [True, True, True, True]]`` gives ``[2, 4]``. Appending a False
    column makes ``argmin`` (which returns the first minimum) find the end of the run in every row.
    """
    padded = np.concatenate([flags, np.zeros((flags.shape[0], 1), dtype=np.bool_)], axis=1)
    run_lengths: npt.NDArray[np.int64] = np.argmin(padded, axis=1).astype(np.int64)
    return run_lengths


@dataclass(frozen=True)
class VerifyRequest:
    """One sequence's part of a batched verification: its drafts, and how its target distribution is drawn.

    Its target rows are ``len(draft_ids) + 1``: the distribution after the context, then after each draft.
    A request without drafts is a plain step (the first token after a prompt, or a step without drafting).
    """

    draft_ids: Sequence[int]  # [k]
    params: SamplingParams
    """Greedy (temperature 0) takes the argmax and builds no probabilities."""
    draft_probs: Any = None  # [k, vocab] float64 where the verifier works, or None: one-hot drafts
    accept_uniforms: npt.NDArray[np.float64] | None = None  # [k] float64: coins against draft_probs
    sample_uniforms: npt.NDArray[np.float64] | None = None  # [k + 1] float64: recovered or bonus token
    adjustment: LogitAdjustment | None = None
    """Grammar mask, logit_bias and penalties for its rows (verify/adjust.py); None: the raw logits."""

    @property
    def num_rows(self) -> int:
        return len(self.draft_ids) + 1


class Verifier(Protocol[LogitsT_contra]):
    """Turns a step's target logits into the tokens each sequence emits, where the logits are.

    ``target_logits`` holds the requests' rows back to back (``[sum of num_rows, vocab]``), as
    ``StepLogits.rows`` of the decode that scored them. Returns per request its accepted drafts followed by
    one recovered or bonus token, as host integers: the only thing that crosses back from a device.
    """

    def verify(self, target_logits: LogitsT_contra, requests: Sequence[VerifyRequest]) -> list[list[int]]: ...
