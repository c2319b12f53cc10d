"""The verifier for logits on the host (numpy): argmax for greedy sequences, per-sequence filtering and
rejection sampling for sampled ones.

When every sequence of the step is greedy and unadjusted — the common case — they share one pass: the
argmax of every row of the step at once, then the longest agreeing prefix of each sequence in plain
integers (:func:`~specserve.verify.greedy.accept_greedy_choices`: no logits are copied, no softmax is
computed, no array is padded). Otherwise each greedy sequence takes the argmax of its own (adjusted) rows
and :func:`~specserve.verify.greedy.verify_greedy_choices` reads the padded choices. A sampled sequence
has its own temperature, top-k, top-p and min-p, so its rows are filtered on their own and verified by
:func:`~specserve.verify.rejection.verify_rejection`. A request with a grammar or penalties has a copy of its
rows adjusted first (verify/adjust.py): greedy takes their argmax, sampling filters them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from specserve.verify.adjust import adjust_logits
from specserve.verify.greedy import accept_greedy_choices, verify_greedy_choices
from specserve.verify.rejection import verify_rejection
from specserve.verify.sampling import filter_logits_to_probs, greedy_argmax
from specserve.verify.types import PLACEHOLDER_TOKEN_ID, VerifyRequest


class HostVerifier:
    """:class:`~specserve.verify.types.Verifier` over numpy logits ``[rows, vocab]`` float32."""

    def verify(
        self,
        target_logits: npt.NDArray[np.float32],  # [sum of num_rows, vocab] float32, requests back to back
        requests: Sequence[VerifyRequest],
    ) -> list[list[int]]:
        if all(r.params.greedy and r.adjustment is None for r in requests):  # the common case: one argmax
            return accept_greedy_choices(
                greedy_argmax(target_logits).tolist(), requests, target_logits.shape[-1]
            )
        starts = np.cumsum([0, *(r.num_rows for r in requests)])
        if target_logits.shape[0] != starts[-1]:
            raise ValueError(f"target_logits has {target_logits.shape[0]} rows, the requests {starts[-1]}")
        adjusted = _adjusted(target_logits, requests, starts)
        emitted: list[list[int]] = [[] for _ in requests]
        greedy = [b for b, r in enumerate(requests) if r.params.greedy]
        if greedy:
            chosen = self._greedy(target_logits, adjusted, requests, starts, greedy)
            for b, tokens in zip(greedy, chosen, strict=True):
                emitted[b] = tokens
        for b, request in enumerate(requests):
            if not request.params.greedy:
                rows = adjusted.get(b, target_logits[starts[b] : starts[b + 1]])
                emitted[b] = _sampled(rows, request)
        return emitted

    @staticmethod
    def _greedy(
        target_logits: npt.NDArray[np.float32],  # [rows, vocab] float32
        adjusted: dict[int, npt.NDArray[np.float32]],  # request → its adjusted rows [num_rows, vocab]
        requests: Sequence[VerifyRequest],
        starts: npt.NDArray[np.int64],  # [len(requests) + 1] int64, where each request's rows begin
        greedy: list[int],  # indices of the greedy requests
    ) -> list[list[int]]:
        """Emitted tokens of the greedy requests: one argmax over all rows when every request is greedy
        (an adjusted request's own rows override its part)."""
        all_choices = greedy_argmax(target_logits) if len(greedy) == len(requests) else None  # [rows]
        max_k = max(len(requests[b].draft_ids) for b in greedy)
        draft_ids = np.full((len(greedy), max_k), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        choices = np.full((len(greedy), max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        for i, b in enumerate(greedy):
            k = len(requests[b].draft_ids)
            draft_ids[i, :k] = requests[b].draft_ids
            lo, hi = starts[b], starts[b + 1]
            if b in adjusted:
                choices[i, : k + 1] = greedy_argmax(adjusted[b])
            elif all_choices is not None:
                choices[i, : k + 1] = all_choices[lo:hi]
            else:
                choices[i, : k + 1] = greedy_argmax(target_logits[lo:hi])
        num_draft = np.array([len(requests[b].draft_ids) for b in greedy], dtype=np.int64)
        result = verify_greedy_choices(draft_ids, num_draft, choices, target_logits.shape[-1])
        return [result.tokens(i) for i in range(len(greedy))]


def _adjusted(
    target_logits: npt.NDArray[np.float32],  # [rows, vocab] float32, not changed
    requests: Sequence[VerifyRequest],
    starts: npt.NDArray[np.int64],  # [len(requests) + 1] int64
) -> dict[int, npt.NDArray[np.float32]]:  # request index → its rows [num_rows, vocab], adjusted
    """A copy of each adjusted request's rows with its adjustment applied; the other requests' rows (and the
    runtime's buffer, maybe a view into the model's own memory) are not copied or changed."""
    adjusted: dict[int, npt.NDArray[np.float32]] = {}
    for b, request in enumerate(requests):
        if request.adjustment is not None:
            rows = np.array(target_logits[starts[b] : starts[b + 1]], dtype=np.float32, copy=True)
            adjust_logits(rows, request.adjustment)
            adjusted[b] = rows
    return adjusted


def _sampled(
    rows: npt.NDArray[np.float32],  # [k + 1, vocab] float32
    request: VerifyRequest,
) -> list[int]:
    """One sampled request: its filtered distributions, then lossless rejection sampling of its drafts."""
    k = len(request.draft_ids)
    if request.sample_uniforms is None:
        raise ValueError("a sampled request needs its sample uniforms")
    p = request.params
    target_probs = filter_logits_to_probs(rows, p.temperature, p.top_k, p.top_p, p.min_p)
    draft_probs = request.draft_probs
    result = verify_rejection(
        np.array([request.draft_ids], dtype=np.int64).reshape(1, k),
        np.array([k], dtype=np.int64),
        target_probs[None],
        None if draft_probs is None else draft_probs[None],
        None if request.accept_uniforms is None else request.accept_uniforms[None],
        request.sample_uniforms[None],
    )
    return result.tokens(0)
