"""Greedy verification: keep the drafts that equal the target's argmax.

Under greedy decoding the target's choice at every position is the argmax of its logits, so a draft token is
*accepted* when it equals that argmax at its position, and the first mismatch ends the run. The row then emits
the target's argmax at that position (the *recovered token*) or, when every draft was accepted, its argmax
after the last draft (the *bonus token*). No softmax is computed: output equals plain greedy decoding exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from specserve.verify.sampling import greedy_argmax
from specserve.verify.types import (
    PLACEHOLDER_TOKEN_ID,
    VerifyRequest,
    VerifyResult,
    draft_positions_mask,
    first_false,
)


def verify_greedy(
    draft_token_ids: npt.NDArray[np.int64],  # [batch, max_k] int64, PLACEHOLDER_TOKEN_ID-padded
    num_draft_tokens: npt.NDArray[np.int64],  # [batch] int64, each in [0, max_k]
    target_logits: npt.NDArray[np.floating[Any]],  # [batch, max_k + 1, vocab] float32
) -> VerifyResult:
    """Verify a padded batch of drafts against the target's greedy choices.

    ``target_logits[b, j]`` are the target's logits after the context plus the first ``j`` drafts of row
    ``b``; positions past ``num_draft_tokens[b]`` are padding and ignored.

    Example (one row, drafts ``[4, 7, 2]``, target argmax per position ``[4, 7, 5, 9]``): drafts 4 and 7
    are accepted, draft 2 is rejected, and the row emits ``[4, 7, 5]`` with ``num_accepted = 2``. With
    argmax ``[4, 7, 2, 9]`` all drafts are accepted and the bonus token 9 follows: ``[4, 7, 2, 9]``.
    """
    draft_positions_mask(draft_token_ids, num_draft_tokens, target_logits.shape[-1])  # checks the drafts
    batch, max_k = draft_token_ids.shape
    if target_logits.shape[:-1] != (batch, max_k + 1):
        raise ValueError(f"target_logits must be [{batch}, {max_k + 1}, vocab], got {target_logits.shape}")
    target_choice = greedy_argmax(target_logits)  # [batch, max_k + 1] int64
    return verify_greedy_choices(draft_token_ids, num_draft_tokens, target_choice, target_logits.shape[-1])


def verify_greedy_choices(
    draft_token_ids: npt.NDArray[np.int64],  # [batch, max_k] int64, PLACEHOLDER_TOKEN_ID-padded
    num_draft_tokens: npt.NDArray[np.int64],  # [batch] int64, each in [0, max_k]
    target_choice: npt.NDArray[np.int64],  # [batch, max_k + 1] int64, the target's argmax per position
    vocab_size: int,
) -> VerifyResult:
    """:func:`verify_greedy` after the argmax: for a caller that took the argmax of all its rows at once."""
    is_draft = draft_positions_mask(draft_token_ids, num_draft_tokens, vocab_size)
    batch, max_k = draft_token_ids.shape
    if target_choice.shape != (batch, max_k + 1):
        raise ValueError(f"target_choice must be [{batch}, {max_k + 1}], got {target_choice.shape}")
    matches = is_draft & (draft_token_ids == target_choice[:, :max_k])
    num_accepted = first_false(matches)  # stops at the first mismatch or at the row's draft length

    output_token_ids = np.full((batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
    accepted = np.arange(max_k)[None, :] < num_accepted[:, None]
    output_token_ids[:, :max_k] = np.where(accepted, draft_token_ids, PLACEHOLDER_TOKEN_ID)
    rows = np.arange(batch)
    output_token_ids[rows, num_accepted] = target_choice[rows, num_accepted]  # recovered or bonus token
    return VerifyResult(output_token_ids=output_token_ids, num_accepted=num_accepted)


def accept_greedy_choices(
    choices: list[int],  # [sum of num_rows]: the target's argmax at each row, requests back to back
    requests: Sequence[VerifyRequest],
    vocab_size: int,
) -> list[list[int]]:
    """The emitted tokens of every request from the step's row choices, on the host in plain integers.

    What a step of greedy requests needs once the argmax is taken (one transfer of ``rows`` ids from a
    device): per request its drafts up to the first that differs from its row's choice, then that row's
    choice. Same outcome as :func:`verify_greedy_choices` without padding a batch of arrays for it.
    """
    total = sum(r.num_rows for r in requests)
    if len(choices) != total:
        raise ValueError(f"target_logits has {len(choices)} rows, the requests {total}")
    emitted: list[list[int]] = []
    row = 0
    for request in requests:
        drafts = request.draft_ids
        if drafts and not all(0 <= t < vocab_size for t in drafts):
            raise ValueError(f"draft token ids must lie in [0, {vocab_size})")
        n = 0
        while n < len(drafts) and drafts[n] == choices[row + n]:
            n += 1
        emitted.append([*map(int, drafts[:n]), choices[row + n]])
        row += len(drafts) + 1
    return emitted
