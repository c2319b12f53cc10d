"""Log-probabilities of emitted tokens, from the target rows that chose them.

They are the model's own distribution (vLLM's default ``raw_logprobs``): log-softmax of the raw logits,
before temperature, penalties or a grammar's mask, so they do not depend on how a token was reached — a
draft accepted at row ``j`` gets the logprob plain decoding gets at that position. Only requests that ask
pay for the softmax; on a device it runs there and only the chosen numbers cross to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class TokenLogprobs:
    """One emitted token's log-probability and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    """Up to the requested number of (token id, logprob), most likely first (ties: lowest id)."""


def token_logprobs(
    rows: Any,  # [len(token_ids), vocab] numpy float32 or a torch tensor: row i chose token_ids[i]
    token_ids: Sequence[int],
    top_n: int,
) -> list[TokenLogprobs]:
    """Each token's logprob in its row, and each row's ``top_n`` most likely tokens."""
    if len(token_ids) == 0:
        return []
    if isinstance(rows, np.ndarray):
        chosen, top_ids, top_values = _host(rows, token_ids, top_n)
    else:
        chosen, top_ids, top_values = _device(rows, token_ids, top_n)
    return [
        TokenLogprobs(
            int(t),
            float(chosen[i]),
            tuple((int(a), float(b)) for a, b in zip(top_ids[i], top_values[i], strict=True)),
        )
        for i, t in enumerate(token_ids)
    ]


def _host(
    rows: np.ndarray[Any, Any], token_ids: Sequence[int], top_n: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    values = rows[: len(token_ids)].astype(np.float64)
    values -= values.max(axis=-1, keepdims=True)
    values -= np.log(np.exp(values).sum(axis=-1, keepdims=True))
    chosen = values[np.arange(len(token_ids)), np.asarray(token_ids)]
    order = np.argsort(-values, axis=-1, kind="stable")[:, :top_n]
    return chosen, order, np.take_along_axis(values, order, axis=-1)


def _device(rows: Any, token_ids: Sequence[int], top_n: int) -> tuple[Any, Any, Any]:
    import torch

    values = torch.log_softmax(rows[: len(token_ids)].double(), dim=-1)
    ids = torch.tensor(list(token_ids), device=values.device)
    chosen = values.gather(1, ids[:, None])[:, 0]
    top_values, top_ids = torch.sort(values, dim=-1, descending=True, stable=True)
    packed = torch.cat([chosen[:, None], top_values[:, :top_n], top_ids[:, :top_n].double()], dim=1).cpu()
    return packed[:, 0].numpy(), packed[:, 1 + top_n :].long().numpy(), packed[:, 1 : 1 + top_n].numpy()
