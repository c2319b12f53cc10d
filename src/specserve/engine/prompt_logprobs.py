"""Prompt logprobs: each prompt token's log-probability under the target, from the pass that prefills it.

A request that asks (``SamplingParams.prompt_logprobs``, the completions API's ``echo`` with ``logprobs``)
gets every row of its prompt chunks, not just the last one: row ``j`` of a chunk that starts at prompt
position ``s`` is the target's distribution over token ``s + j + 1``. No second pass runs, and speculation
cannot change them (drafts start after the prompt). The prefix cache does not serve such a request (as in
vLLM: a cached position has no logits left), so its numbers are the same on a cache hit.

The verifier reads only the rows that choose tokens; :func:`take_prompt_logprobs` records the prompt rows'
logprobs and hands it the step's logits without them.
"""

from __future__ import annotations

from typing import Any

from specserve.backends.base import StepLogits, row_offsets
from specserve.sequence import Sequence
from specserve.verify.logprobs import PromptLogprob, token_logprobs, token_ranks


def prefill_rows(seq: Sequence, start: int, n: int) -> int:
    """Logits rows the prefill chunk ``prompt_ids[start : start + n]`` asks for: all of them for prompt
    logprobs, else one on the last chunk (its first token's distribution), else none."""
    if seq.params.prompt_logprobs is not None:
        return n
    return 1 if start + n == len(seq.prompt_ids) else 0


def take_prompt_logprobs(prefills: list[tuple[Sequence, int]], logits: StepLogits[Any]) -> StepLogits[Any]:
    """Record the prompt logprobs of the prefill chunks (the step's first ``len(prefills)`` chunks, before
    ``num_computed`` moves) that asked for all their rows; return the step's logits with only the rows the
    verifier reads (a chunk's last row where its prompt ends, every row of a verify chunk)."""
    if all(seq.params.prompt_logprobs is None for seq, _ in prefills):
        return logits
    keep: list[int] = []
    counts: list[int] = []
    for chunk in range(len(logits)):
        lo, hi = logits.offsets[chunk], logits.offsets[chunk + 1]
        if chunk < len(prefills) and (top := prefills[chunk][0].params.prompt_logprobs) is not None:
            seq, n = prefills[chunk]
            _record(seq, logits[chunk], seq.num_computed, n, top)
            kept = [hi - 1] if seq.num_computed + n == len(seq.prompt_ids) else []
        else:
            kept = list(range(lo, hi))
        keep += kept
        counts.append(len(kept))
    return StepLogits(logits.rows[keep], row_offsets(counts))  # numpy or torch: the kept rows, in order


def _record(seq: Sequence, rows: Any, start: int, n: int, top: int) -> None:
    """``rows[j]`` is the distribution over prompt token ``start + j + 1`` (the chunk's last row, on the
    prompt's last chunk, over the first generated token: not a prompt logprob)."""
    targets = seq.prompt_ids[start + 1 : start + n + 1]
    if start == 0:
        seq.prompt_logprobs.append(None)  # the first token has no context to be predicted from
    entries = token_logprobs(rows, targets, top)
    ranks = token_ranks(rows, targets)
    seq.prompt_logprobs += [PromptLogprob(e, rank) for e, rank in zip(entries, ranks, strict=True)]
