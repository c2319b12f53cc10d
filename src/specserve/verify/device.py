"""The verifier for logits in a torch tensor, on any device: the whole step in a few batched tensor ops.

A step of greedy requests only is one argmax over its rows and one transfer of their ids; the drafts are
accepted on the host (:func:`~specserve.verify.greedy.accept_greedy_choices`): no index tensors are
uploaded, no kernel runs but the argmax. Otherwise every row of the step gets one *target choice*: the
argmax of its raw logits for a greedy request (one argmax over the step; greedy rows never build
probabilities), or for a sampled request the token drawn from its
filtered distribution with the row's uniform (one filtering pass over all sampled rows, each with its
request's knobs; one inverse CDF). A draft is accepted when it equals the target choice at its position —
greedy agreement, and for one-hot drafts the rejection test of verify/rejection.py — or, with
``draft_probs``, when ``u * draft_probs(x) < target_probs(x)``. Each request emits its accepted prefix and
the target choice where it stopped, except that a draft-probs request rejected where its residual
``max(target_probs - draft_probs, 0)`` has mass emits a token drawn from that residual. The outcome equals
:class:`~specserve.verify.host.HostVerifier`'s token for token (greedy exactly; sampled up to a uniform
landing within float64 rounding of a cumulative boundary, as torch and numpy sum in different orders).

The host builds the step's small index and knob arrays in one loop over the requests and sends them in one
non-blocking copy per dtype (backends/torch/transfer.py: pinned on CUDA, so the host does not wait for the
forward pass); the emitted ids come back in one copy at the end, the step's one wait. Requests with a
grammar or penalties have their rows adjusted on the device first (verify/device_adjust.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from specserve.backends.torch.transfer import upload
from specserve.verify.device_adjust import adjusted_logits
from specserve.verify.device_sampling import (
    filter_logits_to_probs,
    greedy_argmax,
    sample_inverse_cdf,
    uses_rank_filters,
)
from specserve.verify.greedy import accept_greedy_choices
from specserve.verify.types import PLACEHOLDER_TOKEN_ID, VerifyRequest, draft_positions_mask


class TorchVerifier:
    """:class:`~specserve.verify.types.Verifier` over torch logits ``[rows, vocab]`` (float32, bf16, fp16).

    ``VerifyRequest.draft_probs`` may be a numpy array or a tensor on any device, ``[k, vocab]``; it is read
    as float64 on the logits' device (float64 where it is made saves a cast and a copy).
    """

    def verify(
        self,
        target_logits: torch.Tensor,  # [sum of num_rows, vocab] float32/bf16/fp16, requests back to back
        requests: Sequence[VerifyRequest],
    ) -> list[list[int]]:
        if target_logits.ndim != 2:
            raise ValueError(f"target_logits must be [rows, vocab], got shape {list(target_logits.shape)}")
        rows, vocab = target_logits.shape
        if any(r.adjustment is not None for r in requests):
            target_logits = adjusted_logits(target_logits, requests)
        if all(r.params.greedy for r in requests):  # the common case: one argmax, one transfer of its ids
            return accept_greedy_choices(greedy_argmax(target_logits).tolist(), requests, vocab)
        step = StepTensors.build(requests, rows, vocab, target_logits.device)
        if not requests:
            return []
        packed = verify_step(target_logits, step).tolist()  # the one device→host transfer
        emitted: list[list[int]] = []
        for b, row in enumerate(packed):
            tokens = row[: row[-1] + 1]
            if PLACEHOLDER_TOKEN_ID in tokens:  # sample_inverse_cdf's mark of a row without probabilities
                raise ValueError(f"request {b}: every row of probs needs a positive sum (no finite logit?)")
            emitted.append(tokens)
        return emitted


@dataclass(frozen=True)
class StepTensors:
    """A step's requests as padded index and knob tensors on the logits' device.

    *Sampled rows* are the rows of the sampled requests, back to back, in request order: the rows of
    ``target_probs``. The ``dp_`` fields describe the requests that carry ``draft_probs`` and drafts.
    """

    draft_token_ids: torch.Tensor  # [batch, max_k] int64, PLACEHOLDER_TOKEN_ID-padded
    num_draft_tokens: torch.Tensor  # [batch] int64
    position_rows: torch.Tensor  # [batch, max_k + 1] int64: logits row per position, padded with the last
    sampled_rows: torch.Tensor  # [sampled] int64: logits row of each sampled row
    temperature: torch.Tensor  # [sampled] float64, the row's request's
    top_k: torch.Tensor  # [sampled] int64
    top_p: torch.Tensor  # [sampled] float64
    min_p: torch.Tensor  # [sampled] float64
    row_uniforms: torch.Tensor  # [sampled] float64: the sample uniform of each sampled row's position
    dp_index: torch.Tensor  # [dp] int64: the requests with draft_probs and drafts
    dp_draft_token_ids: torch.Tensor  # [dp, max_k] int64, PLACEHOLDER_TOKEN_ID-padded
    dp_num_draft_tokens: torch.Tensor  # [dp] int64, each >= 1
    dp_target_rows: torch.Tensor  # [dp, max_k + 1] int64: sampled row of each position
    dp_draft_rows: torch.Tensor  # [dp, max_k] int64: row of draft_probs of each draft position
    dp_accept_uniforms: torch.Tensor  # [dp, max_k] float64, 0-padded
    draft_probs: torch.Tensor  # [sum of dp drafts, vocab] float64
    all_greedy: bool
    all_sampled: bool
    rank_filters: bool  # some sampled request uses top-k or top-p

    @classmethod
    def build(
        cls, requests: Sequence[VerifyRequest], rows: int, vocab: int, device: torch.device
    ) -> StepTensors:
        """Check the requests as the host verifier does and lay them out: one loop over requests, one copy
        to ``device`` per dtype (numpy ``draft_probs`` ride with the float knobs)."""
        num_draft = np.array([len(r.draft_ids) for r in requests], dtype=np.int64)
        batch, max_k = len(requests), int(num_draft.max(initial=0))
        starts = np.concatenate([[0], np.cumsum(num_draft + 1)]).astype(np.int64)
        if rows != starts[-1]:
            raise ValueError(f"target_logits has {rows} rows, the requests {starts[-1]}")
        draft_token_ids = np.full((batch, max_k), PLACEHOLDER_TOKEN_ID, dtype=np.int64)
        for b, request in enumerate(requests):
            draft_token_ids[b, : num_draft[b]] = request.draft_ids
        draft_positions_mask(draft_token_ids, num_draft, vocab)  # raises on ids outside the vocabulary
        offsets = np.minimum(np.arange(max_k + 1)[None, :], num_draft[:, None])  # [batch, max_k + 1]

        sampled = [b for b, r in enumerate(requests) if not r.params.greedy]
        sampled_num_rows = num_draft[sampled] + 1
        sampled_starts = np.concatenate([[0], np.cumsum(sampled_num_rows)]).astype(np.int64)
        row_uniforms: list[npt.NDArray[np.float64]] = []
        dp: list[tuple[int, int]] = []  # (sampled index, request index) of the draft-probs requests
        dp_probs: list[Any] = []  # [k, vocab] each, numpy or torch
        dp_uniforms: list[npt.NDArray[np.float64]] = []  # [k] each
        for i, b in enumerate(sampled):
            request, k = requests[b], int(num_draft[b])
            row_uniforms.append(_checked(f"request {b}", "sample_uniforms", request.sample_uniforms, k + 1))
            if request.draft_probs is not None:
                accept_uniforms = _checked(f"request {b}", "accept_uniforms", request.accept_uniforms, k)
                if tuple(request.draft_probs.shape) != (k, vocab):
                    shape = list(request.draft_probs.shape)
                    raise ValueError(f"request {b}: draft_probs must have shape [{k}, {vocab}], got {shape}")
                if k:  # without drafts, draft_probs changes nothing: the row samples its bonus token
                    dp.append((i, b))
                    dp_probs.append(request.draft_probs)
                    dp_uniforms.append(accept_uniforms)
        dp_index = np.array([b for _, b in dp], dtype=np.int64)
        dp_num_draft = num_draft[dp_index]
        dp_draft_starts = np.concatenate([[0], np.cumsum(dp_num_draft)]).astype(np.int64)[:-1]
        dp_accept_uniforms = np.zeros((len(dp), max_k), dtype=np.float64)
        for j, accept_uniforms in enumerate(dp_uniforms):
            dp_accept_uniforms[j, : accept_uniforms.size] = accept_uniforms
        params = [requests[b].params for b in sampled]
        host_probs = all(isinstance(x, np.ndarray) for x in dp_probs)

        int_arrays = {
            "draft_token_ids": draft_token_ids,
            "num_draft_tokens": num_draft,
            "position_rows": starts[:-1, None] + offsets,
            "sampled_rows": np.concatenate(
                [np.zeros(0, dtype=np.int64), *(np.arange(starts[b], starts[b + 1]) for b in sampled)]
            ),
            "top_k": np.repeat([p.top_k for p in params], sampled_num_rows).astype(np.int64),
            "dp_index": dp_index,
            "dp_draft_token_ids": draft_token_ids[dp_index],
            "dp_num_draft_tokens": dp_num_draft,
            "dp_target_rows": sampled_starts[[i for i, _ in dp]][:, None] + offsets[dp_index],
            "dp_draft_rows": dp_draft_starts[:, None]
            + np.minimum(np.arange(max_k)[None, :], dp_num_draft[:, None] - 1),
        }
        float_arrays = {
            "temperature": np.repeat([p.temperature for p in params], sampled_num_rows),
            "top_p": np.repeat([p.top_p for p in params], sampled_num_rows),
            "min_p": np.repeat([p.min_p for p in params], sampled_num_rows),
            "row_uniforms": np.concatenate([np.zeros(0), *row_uniforms]),
            "dp_accept_uniforms": dp_accept_uniforms,
        }
        if host_probs:
            float_arrays["draft_probs"] = np.concatenate([np.zeros((0, vocab)), *dp_probs])
        tensors = upload(
            {n: np.asarray(a, np.int64) for n, a in int_arrays.items()}
            | {n: np.asarray(a, np.float64) for n, a in float_arrays.items()},
            device,
        )
        if not host_probs:
            tensors["draft_probs"] = torch.cat(
                [
                    torch.as_tensor(x).to(device=device, dtype=torch.float64, non_blocking=True)
                    for x in dp_probs
                ]
            )
        return cls(
            **tensors,
            all_greedy=not sampled,
            all_sampled=len(sampled) == batch,
            rank_filters=uses_rank_filters(params, vocab),
        )


def verify_step(
    target_logits: torch.Tensor,  # [rows, vocab] float32/bf16/fp16
    step: StepTensors,
) -> torch.Tensor:  # [batch, max_k + 2] int64: output_token_ids, then num_accepted
    """The emitted tokens of every request of the step, padded, with the accepted counts as a last column."""
    row_choice, target_probs = target_row_choices(target_logits, step)
    target_choice = row_choice[step.position_rows]  # [batch, max_k + 1] int64
    max_k = step.draft_token_ids.shape[1]
    is_draft = torch.arange(max_k, device=row_choice.device) < step.num_draft_tokens[:, None]
    accepted = is_draft & (step.draft_token_ids == target_choice[:, :max_k])  # greedy, one-hot drafts
    if target_probs is not None and step.dp_index.numel():
        dp_accepted = accept_against_draft_probs(
            step.dp_draft_token_ids,
            step.dp_num_draft_tokens,
            target_probs,
            step.dp_target_rows,
            step.draft_probs,
            step.dp_draft_rows,
            step.dp_accept_uniforms,
        )
        accepted[step.dp_index] = dp_accepted  # index_put: no device read, unlike a mask
    num_accepted = first_false(accepted)  # [batch] int64
    final_tokens = target_choice.gather(1, num_accepted[:, None])[:, 0]  # [batch]: recovered or bonus
    if target_probs is not None and step.dp_index.numel():
        recovered, use_recovered = recover_from_residuals(
            num_accepted[step.dp_index],
            step.dp_num_draft_tokens,
            target_probs,
            step.dp_target_rows,
            step.draft_probs,
            step.dp_draft_rows,
            step.row_uniforms,
        )
        dp_final = torch.where(use_recovered, recovered, final_tokens[step.dp_index])
        final_tokens[step.dp_index] = dp_final
    output_token_ids = padded_output(step.draft_token_ids, num_accepted, final_tokens)
    return torch.cat([output_token_ids, num_accepted[:, None]], dim=1)


def target_row_choices(
    target_logits: torch.Tensor,  # [rows, vocab] float32/bf16/fp16
    step: StepTensors,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [rows] int64; [sampled, vocab] float64, None if all greedy
    """The target's choice at every row: the argmax for greedy requests, the row's sample for sampled ones;
    and the sampled rows' filtered distributions, which rejection against draft_probs reads."""
    if step.all_greedy:  # the common case: no probabilities at all
        return greedy_argmax(target_logits), None
    sampled_logits = target_logits if step.all_sampled else target_logits.index_select(0, step.sampled_rows)
    target_probs = filter_logits_to_probs(
        sampled_logits, step.temperature, step.top_k, step.top_p, step.min_p, rank_filters=step.rank_filters
    )
    samples = sample_inverse_cdf(target_probs, step.row_uniforms)  # [sampled] int64
    if step.all_sampled:
        return samples, target_probs
    # One argmax over every row reads the logits once; the sampled rows' argmax is then overwritten.
    return greedy_argmax(target_logits).index_copy(0, step.sampled_rows, samples), target_probs


def accept_against_draft_probs(
    draft_token_ids: torch.Tensor,  # [n, max_k] int64, PLACEHOLDER_TOKEN_ID-padded
    num_draft_tokens: torch.Tensor,  # [n] int64
    target_probs: torch.Tensor,  # [rows, vocab] float64
    target_rows: torch.Tensor,  # [n, max_k + 1] int64: row of target_probs at each position
    draft_probs: torch.Tensor,  # [draft rows, vocab] float64
    draft_rows: torch.Tensor,  # [n, max_k] int64: row of draft_probs at each draft position
    accept_uniforms: torch.Tensor,  # [n, max_k] float64 in [0, 1)
) -> torch.Tensor:  # [n, max_k] bool
    """Each draft's own accept test, ``u < target/draft`` written without division; padding is False."""
    max_k = draft_token_ids.shape[1]
    is_draft = torch.arange(max_k, device=draft_token_ids.device) < num_draft_tokens[:, None]
    gather_ids = draft_token_ids.clamp(min=0)  # padding reads id 0, masked below
    target_at_draft = target_probs[target_rows[:, :max_k], gather_ids]
    draft_at_draft = draft_probs[draft_rows, gather_ids]
    return is_draft & (accept_uniforms * draft_at_draft < target_at_draft)


def recover_from_residuals(
    num_accepted: torch.Tensor,  # [n] int64
    num_draft_tokens: torch.Tensor,  # [n] int64, each >= 1
    target_probs: torch.Tensor,  # [rows, vocab] float64
    target_rows: torch.Tensor,  # [n, max_k + 1] int64: row of target_probs at each position
    draft_probs: torch.Tensor,  # [draft rows, vocab] float64
    draft_rows: torch.Tensor,  # [n, max_k] int64: row of draft_probs at each draft position
    row_uniforms: torch.Tensor,  # [rows] float64: the sample uniform of each row of target_probs
) -> tuple[torch.Tensor, torch.Tensor]:  # [n] int64 recovered token, [n] bool whether it replaces the choice
    """The token drawn from ``max(target_probs - draft_probs, 0)`` at each row's first rejected draft.

    A row that accepted every draft, or whose residual is all zero (rounding alone can do that), keeps the
    target's own sample at its stopping position, as verify/rejection.py does.
    """
    stop_rows = target_rows.gather(1, num_accepted[:, None])[:, 0]  # [n]
    max_k = draft_rows.shape[1]
    draft_stop_rows = draft_rows.gather(1, num_accepted.clamp(max=max_k - 1)[:, None])[:, 0]  # [n]
    residuals = (target_probs[stop_rows] - draft_probs[draft_stop_rows]).clamp_(min=0.0)  # [n, vocab]
    use_residual = (num_accepted < num_draft_tokens) & (residuals.sum(dim=-1) > 0)
    return sample_inverse_cdf(residuals, row_uniforms[stop_rows]), use_residual


def first_false(
    flags: torch.Tensor,  # [batch, width] bool
) -> torch.Tensor:  # [batch] int64 in [0, width]
    """Length of the leading run of True in each row (``width`` when the whole row is True)."""
    return flags.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def padded_output(
    draft_token_ids: torch.Tensor,  # [batch, max_k] int64, PLACEHOLDER_TOKEN_ID-padded
    num_accepted: torch.Tensor,  # [batch] int64
    final_tokens: torch.Tensor,  # [batch] int64: the recovered or bonus token
) -> torch.Tensor:  # [batch, max_k + 1] int64, PLACEHOLDER_TOKEN_ID-padded
    """The accepted drafts, then the final token at position ``num_accepted``."""
    batch, max_k = draft_token_ids.shape
    is_accepted = torch.arange(max_k, device=draft_token_ids.device) < num_accepted[:, None]
    output = torch.full(
        (batch, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=draft_token_ids.device
    )
    output[:, :max_k] = torch.where(is_accepted, draft_token_ids, PLACEHOLDER_TOKEN_ID)
    return output.scatter_(1, num_accepted[:, None], final_tokens[:, None])


def _checked(
    where: str, name: str, uniforms: npt.NDArray[np.float64] | None, size: int
) -> npt.NDArray[np.float64]:
    if uniforms is None:
        needs = "its sample uniforms" if name == "sample_uniforms" else "accept_uniforms with draft_probs"
        raise ValueError(f"{where}: a sampled request needs {needs}")
    if uniforms.shape != (size,):
        raise ValueError(f"{where}: {name} must have shape [{size}], got {list(uniforms.shape)}")
    return np.asarray(uniforms, dtype=np.float64)
