"""Token log-probabilities in the OpenAI shapes: chat's ``{"content": [...]}`` and the legacy completions'
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specserve.verify.logprobs import TokenLogprobs

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
