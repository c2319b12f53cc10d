"""Runs and scores for the in-process rollout checks (``verify --in-process``, ``evaluate``).

The models are loaded once by the engine's builder (:func:`specserve.engine.builder.load_models`); each run
makes a fresh engine over them with exactly the drafters and policy asked for, so configurations cannot leak
into each other, and scoring reads the target's logits directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from specserve.backends.base import DecodeChunk, ModelRuntime, to_host
from specserve.chat import chat_prompt_ids
from specserve.config import Settings
from specserve.engine.builder import LoadedModels
from specserve.engine.draft_policy import DraftLengthPolicy, FixedLengthPolicy
from specserve.engine.offline import OfflineEngine
from specserve.engine.output_processor import RequestState
from specserve.engine.runtimes import open_runtime
from specserve.request import SamplingParams
from specserve.tools.workloads import ToolInputError

Runtime = ModelRuntime[Any]
"""A runtime of either kind: the logits this module reads are brought to the host (to_host)."""

SCORE_CHUNK = 256  # tokens per decode call when scoring (within every runtime's batch capacity)


def prompt_ids(models: LoadedModels, prompt: str) -> list[int]:
    """The user prompt as a chat turn, tokenized as the server does."""
    return chat_prompt_ids(models.target, [{"role": "user", "content": prompt}])


def generate(
    models: LoadedModels,
    ids: list[int],
    params: SamplingParams,
    drafters: tuple[str, ...] = (),
    num_draft_tokens: int = 0,
    policy: DraftLengthPolicy | None = None,
) -> RequestState:
    """One request alone on a fresh engine; ``drafters=()`` is plain decoding."""
    engine = OfflineEngine(models.engine(drafters, policy or FixedLengthPolicy(), num_draft_tokens))
    try:
        request = engine.add_request("inprocess-0", ids, params)
    except ValueError as exc:  # the prompt does not fit the context
        raise ToolInputError(str(exc)) from None
    engine.run()
    return request  # not engine.close(): that would close the shared runtimes


def open_reference(settings: Settings, path: str) -> Runtime:
    """Another target for the plain arm of ``verify`` (e.g. a requantized model)."""
    from specserve.models import ModelStore

    store = ModelStore(Path(settings.model_dir) if settings.model_dir else None)
    return open_runtime(str(store.resolve(path)), settings, 1)


def _decode_all(runtime: Runtime, tokens: list[int], start: int, first_logit: int) -> npt.NDArray[np.float64]:
    """Append ``tokens`` at ``start`` on slot 0; logits of positions ``>= first_logit`` (absolute)."""
    rows = []
    for a in range(0, len(tokens), SCORE_CHUNK):
        chunk = tokens[a : a + SCORE_CHUNK]
        lo = start + a
        wanted = max(0, lo + len(chunk) - max(first_logit, lo))
        logits = runtime.decode([DecodeChunk(0, chunk, lo, wanted)])[0]
        if wanted:
            rows.append(np.array(to_host(logits), dtype=np.float64))
    return np.concatenate(rows) if rows else np.zeros((0, runtime.info.vocab_size))


def next_token_logits(runtime: Runtime, prefix: list[int]) -> npt.NDArray[np.float64]:
    """The target's logits for the token after ``prefix`` (a fresh prefill on slot 0)."""
    runtime.free(0)
    try:
        logits: npt.NDArray[np.float64] = _decode_all(runtime, prefix, 0, len(prefix) - 1)[-1]
        return logits
    finally:
        runtime.free(0)


def output_logprobs(
    runtime: Runtime, ids: list[int], outputs: list[list[int]]
) -> list[npt.NDArray[np.float64]]:
    """Per output, ``log p(output[j] | prompt + output[:j])`` under the raw (temperature 1) target.

    The prompt is prefilled once; each output is appended after it and rolled back with a truncate.
    """
    runtime.free(0)
    base = len(ids) - 1
    try:
        if base:
            _decode_all(runtime, ids[:-1], 0, base + 1)  # no logits
        scores = []
        for output in outputs:
            if not output:
                scores.append(np.zeros(0))
                continue
            logits = _decode_all(runtime, [ids[-1], *output[:-1]], base, base)
            shifted = logits - logits.max(axis=1, keepdims=True)
            log_norm = np.log(np.exp(shifted).sum(axis=1))
            scores.append(shifted[np.arange(len(output)), output] - log_norm)
            runtime.truncate(0, base)
        return scores
    finally:
        runtime.free(0)
