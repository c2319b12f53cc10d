"""Token log-probabilities in the OpenAI shapes: chat's ``{"content": [...]}`` and the legacy completions'
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (of the output, and of an echoed prompt);
vLLM's ``prompt_logprobs``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specserve.verify.logprobs import PromptLogprob, TokenLogprobs

TokenBytes = Callable[[int], bytes]


def _text(token_bytes: TokenBytes, token: int) -> tuple[str, list[int]]:
    raw = token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(token_bytes: TokenBytes, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    content = []
    for entry in entries:
        text, raw = _text(token_bytes, entry.token_id)
        top = []
        for token, logprob in entry.top:
            alt_text, alt_raw = _text(token_bytes, token)
            top.append({"token": alt_text, "logprob": logprob, "bytes": alt_raw})
        content.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(
    token_bytes: TokenBytes, entries: Sequence[TokenLogprobs], offset: int = 0
) -> dict[str, Any]:
    """``offset``: characters of text before the first token (the echoed prompt, earlier stream chunks)."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text, _ = _text(token_bytes, entry.token_id)
        tokens.append(text)
        logprobs.append(entry.logprob)
        tops.append({_text(token_bytes, t)[0]: lp for t, lp in entry.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def echoed_logprobs(
    token_bytes: TokenBytes,
    prompt_ids: Sequence[int],
    prompt_logprobs: Sequence[PromptLogprob | None],
    top_n: int,
) -> dict[str, Any]:
    """The legacy completions' logprobs of an echoed prompt: every prompt token, the first with ``null``
    (nothing predicts it), each with its ``top_n`` alternatives; offsets from the prompt's start."""
    tokens, logprobs, tops, offsets = [], [], [], []
    offset = 0
    for token, entry in zip(prompt_ids, prompt_logprobs, strict=True):
        text, _ = _text(token_bytes, token)
        tokens.append(text)
        logprobs.append(None if entry is None else entry.entry.logprob)
        alternatives = None if entry is None else entry.entry.top[:top_n]
        tops.append(
            None if alternatives is None else {_text(token_bytes, t)[0]: lp for t, lp in alternatives}
        )
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(
    token_bytes: TokenBytes, prompt_logprobs: Sequence[PromptLogprob | None], top_n: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first ``null``), ``{token id: {"logprob", "rank",
    "decoded_token"}}`` for the prompt token and its position's ``top_n`` most likely tokens."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for entry in prompt_logprobs:
        if entry is None:
            result.append(None)
            continue
        position = {
            str(token): {"logprob": lp, "rank": rank, "decoded_token": _text(token_bytes, token)[0]}
            for rank, (token, lp) in enumerate(entry.entry.top[:top_n], start=1)
        }
        chosen = entry.entry.token_id
        position.setdefault(
            str(chosen),
            {
                "logprob": entry.entry.logprob,
                "rank": entry.rank,
                "decoded_token": _text(token_bytes, chosen)[0],
            },
        )
        result.append(position)
    return result
