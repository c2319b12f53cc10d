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
    """Up to the requested number of (token id, logprob), most likely first (ties: lowest id first; which of
    several tokens tied at the last place makes the list is unspecified)."""


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's logprobs, and its rank in its row (1: the target's most likely token)."""

    entry: TokenLogprobs
    rank: int


def token_logprobs(
    rows: Any,  # [len(token_ids), vocab] numpy float32 or a torch tensor: row i chose token_ids[i]
    token_ids: Sequence[int],
    top_n: int,
) -> list[TokenLogprobs]:
    """Each token's logprob in its row, and each row's ``top_n`` most likely tokens."""
    if len(token_ids) == 0:
        return []
    return step_token_logprobs(rows, [(0, token_ids, top_n)])[0]


def step_token_logprobs(
    rows: Any,  # [R, vocab] numpy float32 or a torch tensor: a step's logits rows
    requests: Sequence[tuple[int, Sequence[int], int]],  # (first row, token_ids, top_n) each
) -> list[list[TokenLogprobs]]:
    """:func:`token_logprobs` of several requests of one step, row ``first + i`` having chosen
    ``token_ids[i]``: on a device one upload and one read for all of them, not two per request."""
    if isinstance(rows, np.ndarray):
        found = [_host(rows[first : first + len(ids)], ids, n) for first, ids, n in requests]
    else:
        found = _device(rows, requests)
    return [
        [
            TokenLogprobs(
                int(t),
                float(chosen[i]),
                tuple((int(a), float(b)) for a, b in zip(top_ids[i][:n], top_values[i][:n], strict=True)),
            )
            for i, t in enumerate(ids)
        ]
        for (_, ids, n), (chosen, top_ids, top_values) in zip(requests, found, strict=True)
    ]


def _host(
    rows: np.ndarray[Any, Any], token_ids: Sequence[int], top_n: int
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """No sort and no float64 copy of the vocabulary: a log-sum-exp per row (summed in float64), a
    partition for the top's threshold, then only the candidates at or above it sorted."""
    n = len(token_ids)
    logits = rows[:n]
    peak = logits.max(axis=-1, keepdims=True)
    log_total = peak.astype(np.float64) + np.log(
        np.exp(logits - peak).sum(axis=-1, dtype=np.float64, keepdims=True)
    )
    chosen = logits[np.arange(n), np.asarray(token_ids)].astype(np.float64) - log_total[:, 0]
    top = np.zeros((n, top_n), dtype=np.int64)
    if top_n:
        threshold = np.partition(logits, -top_n, axis=-1)[:, -top_n]
        for i in range(n):
            candidates = np.flatnonzero(logits[i] >= threshold[i])  # ascending ids
            order = np.argsort(-logits[i, candidates], kind="stable")[:top_n]  # ties: lowest id first
            top[i] = candidates[order]
    top_values = np.take_along_axis(logits, top, axis=-1).astype(np.float64) - log_total
    return chosen, top, top_values


def _device(rows: Any, requests: Sequence[tuple[int, Sequence[int], int]]) -> list[tuple[Any, Any, Any]]:
    """On the logits' device: a log-softmax of the rows asked for and one ``topk`` at the largest top_n;
    the row indices and ids go up in one non-blocking copy, only the numbers asked for come back."""
    import torch

    from specserve.backends.torch.transfer import upload

    index = [first + i for first, ids, _ in requests for i in range(len(ids))]
    if not index:
        return [(np.zeros(0), np.zeros((0, 0), np.int64), np.zeros((0, 0))) for _ in requests]
    ids = [t for _, token_ids, _ in requests for t in token_ids]
    top_n = max(n for _, _, n in requests)
    on_device = upload({"rows": np.array(index, np.int64), "ids": np.array(ids, np.int64)}, rows.device)
    values = torch.log_softmax(rows.index_select(0, on_device["rows"]).double(), dim=-1)
    chosen = values.gather(1, on_device["ids"][:, None])
    top_values, top_ids = torch.topk(values, top_n, dim=-1) if top_n else (values[:, :0], chosen[:, :0])
    packed = torch.cat([chosen, top_values, top_ids.double()], dim=1).cpu().numpy()  # the one read
    found, start = [], 0
    for _, token_ids, _ in requests:
        part, start = packed[start : start + len(token_ids)], start + len(token_ids)
        found.append((part[:, 0], part[:, 1 + top_n :].astype(np.int64), part[:, 1 : 1 + top_n]))
    return found


def token_ranks(
    rows: Any,  # [len(token_ids), vocab] numpy float32 or a torch tensor
    token_ids: Sequence[int],
) -> list[int]:
    """Each token's rank in its row (1: the most likely; tied tokens share the best rank), as vLLM reports
    a prompt token's."""
    if len(token_ids) == 0:
        return []
    n = len(token_ids)
    if isinstance(rows, np.ndarray):
        logits = rows[:n]
        chosen = logits[np.arange(n), np.asarray(token_ids)]
        return [int(r) + 1 for r in (logits > chosen[:, None]).sum(axis=-1)]
    from specserve.backends.torch.transfer import upload_array

    ids = upload_array(np.array(token_ids, np.int64), rows.device)
    chosen = rows[:n].gather(1, ids[:, None])
    return [int(r) + 1 for r in (rows[:n] > chosen).sum(dim=-1).cpu().tolist()]
