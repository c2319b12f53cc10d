"""The draft model's next token, chosen where its logits are (a torch runtime's device).

Each chain step of the draft model needs its token on the host before the next step can be built, so the
chain waits once per drafted position whatever is done. What crosses is the point: on the host path every
row (151,936 floats, 600 KB) came over to be reduced there; here the confidence, the argmax and, for a
sampled request, the filtered distribution and the inverse-CDF draw run on the device with the verifier's
own tensor functions (verify/device_sampling.py, the host's semantics), and only ``[token, confidence]``
per sequence comes back, in one transfer. A sampled request's distribution stays on the device as its
draft probabilities, where the torch verifier reads them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from specserve.backends.torch.transfer import upload
from specserve.request import DRAFT_STREAM
from specserve.sequence import Sequence
from specserve.verify.device_sampling import (
    filter_logits_to_probs,
    greedy_argmax,
    sample_inverse_cdf,
    uses_rank_filters,
)


def choose_on_device(
    rows: torch.Tensor,  # [A, vocab]: the next-token row of each sequence, at the target's width
    seqs: Seq[Sequence],  # [A]
    drafted: Seq[int],  # [A]: drafts each already has this proposal (the position's offset)
) -> tuple[list[int], list[float], list[torch.Tensor | None]]:
    """Each sequence's next draft token, the draft's confidence in its most likely token (a plain softmax's
    top probability, as ``draft_model.top_probability``), and a sampled sequence's distribution ``[vocab]``
    float64 on the device (None for greedy)."""
    logits = rows.double()
    peak = logits.max(dim=-1, keepdim=True).values
    confidence = 1.0 / torch.exp(logits - peak).sum(dim=-1)  # [A] float64
    tokens = greedy_argmax(rows).to(torch.float64)  # [A], exact below 2**53
    sampled = [a for a, seq in enumerate(seqs) if not seq.params.greedy]
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    if sampled:
        params = [seqs[a].params for a in sampled]
        host = {
            "rows": np.array(sampled, np.int64),
            "top_k": np.array([p.top_k for p in params], np.int64),
            "temperature": np.array([p.temperature for p in params], np.float64),
            "top_p": np.array([p.top_p for p in params], np.float64),
            "min_p": np.array([p.min_p for p in params], np.float64),
            "uniforms": np.concatenate(
                [
                    seqs[a].uniforms.take(DRAFT_STREAM, len(seqs[a].output_ids) + drafted[a], 1)
                    for a in sampled
                ]
            ),
        }
        knobs = upload(host, rows.device)
        vocab = rows.shape[-1]
        filtered = filter_logits_to_probs(
            rows.index_select(0, knobs["rows"]), knobs["temperature"], knobs["top_k"], knobs["top_p"],
            knobs["min_p"], rank_filters=uses_rank_filters(params, vocab),
        )  # fmt: skip
        draws = sample_inverse_cdf(filtered, knobs["uniforms"])
        tokens = tokens.index_copy(0, knobs["rows"], draws.to(torch.float64))
        for j, a in enumerate(sampled):
            probs[a] = filtered[j]
    packed = torch.stack([tokens, confidence], dim=1).tolist()  # the one wait of a chain step
    return [int(t) for t, _ in packed], [c for _, c in packed], probs
