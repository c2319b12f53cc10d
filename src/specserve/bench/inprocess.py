"""Models loaded once for the in-process tools (``verify``, ``evaluate``): run one request, score outputs.

Each run builds a fresh :class:`SpeculativeEngine` over the shared runtimes with exactly the drafters and
length policy the caller asks for (as ``engine_bench`` does), so configurations cannot leak into each other.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from specserve.backends.base import DecodeChunk, ModelRuntime
from specserve.chat import chat_prompt_ids
from specserve.config import Settings
from specserve.drafters.base import Drafter
from specserve.engine.draft_policy import DraftLengthPolicy, FixedLengthPolicy
from specserve.drafters.registry import DrafterContext, build_drafter
from specserve.engine.builder import calibration_key, open_runtime
from specserve.engine.cost_model import CostModel, cached_calibration
from specserve.engine.engine import EngineOptions, SpeculativeEngine
from specserve.sequence import Sequence
from specserve.request import SamplingParams

SCORE_CHUNK = 256  # tokens per decode call when scoring (within every runtime's batch capacity)


@dataclass
class Models:
    target: ModelRuntime
    costs: CostModel
    """Live costs: engines refine them as they run."""
    calibrated: CostModel
    """The costs as calibrated at load (a snapshot: what expected speed-ups are computed from)."""
    drafters: dict[str, Drafter] = field(default_factory=dict)
    runtimes: list[ModelRuntime] = field(default_factory=list)

    @property
    def max_draft_tokens(self) -> int:
        """The engine's cap on draft tokens per step (exact mode: RuntimeInfo.max_verify_tokens - 1)."""
        return self.target.info.max_verify_tokens - 1

    def prompt_ids(self, prompt: str) -> list[int]:
        """The user prompt as a chat turn, tokenized as the server does."""
        return chat_prompt_ids(self.target, [{"role": "user", "content": prompt}])

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        drafters: tuple[str, ...] = (),
        num_draft_tokens: int = 0,
        policy: DraftLengthPolicy | None = None,
    ) -> Sequence:
        """One request alone on a fresh engine; ``drafters=()`` is plain decoding."""
        options = EngineOptions(drafters, num_draft_tokens, speculation_enabled=bool(drafters))
        chosen = {name: self.drafters[name] for name in drafters}
        engine = SpeculativeEngine(self.target, chosen, policy or FixedLengthPolicy(), self.costs, options)
        seq = engine.add_request("inprocess-0", prompt_ids, params)
        while engine.has_work():
            engine.step()
        return seq  # not engine.close(): that would close the shared runtimes

    def close(self) -> None:
        for runtime in self.runtimes:
            runtime.close()


@contextmanager
def load_models(settings: Settings, with_draft: bool = True) -> Iterator[Models]:
    """Target (and draft, if configured and ``with_draft``) with one sequence each, calibrated."""
    from specserve.models import ModelStore, check_draft_compatible, read_vocab

    store = ModelStore(Path(settings.model_dir) if settings.model_dir else None)
    target_path = store.resolve(settings.target)
    calib_dir = store.cache_dir / "calibration" if settings.calibration_cache else None
    runtimes: list[ModelRuntime] = []
    try:
        target = open_runtime(str(target_path), settings, 1)
        runtimes.append(target)
        key = calibration_key(settings, target)  # as build_engine keys it, so both share the cache
        costs = CostModel(cached_calibration(target, 0, calib_dir, key))
        draft_runtime = None
        if with_draft and settings.draft_path_or_none:
            draft_path = store.resolve(settings.draft_path_or_none)
            check_draft_compatible(read_vocab(target_path), read_vocab(draft_path))
            draft_runtime = open_runtime(str(draft_path), settings, 1, self_check=False)
            runtimes.append(draft_runtime)
            costs.draft = cached_calibration(draft_runtime, 0, calib_dir, key)
        context = DrafterContext(draft_runtime, settings.ngram_min_n, settings.draft_p_min)
        drafters = {"ngram": build_drafter("ngram", context)}
        if draft_runtime is not None:
            drafters["draft-model"] = build_drafter("draft-model", context)
        models = Models(target, costs, copy.deepcopy(costs), drafters, runtimes)
    except BaseException:
        for runtime in runtimes:
            runtime.close()
        raise
    try:
        yield models
    finally:
        models.close()


def open_reference(settings: Settings, path: str) -> ModelRuntime:
    """Another target for the plain arm of ``verify`` (e.g. a requantized model)."""
    from specserve.models import ModelStore

    store = ModelStore(Path(settings.model_dir) if settings.model_dir else None)
    return open_runtime(str(store.resolve(path)), settings, 1)


def _decode_all(
    runtime: ModelRuntime, tokens: list[int], start: int, first_logit: int
) -> npt.NDArray[np.float64]:
    """Append ``tokens`` at ``start`` on slot 0; logits of positions ``>= first_logit`` (absolute)."""
    rows = []
    for a in range(0, len(tokens), SCORE_CHUNK):
        chunk = tokens[a : a + SCORE_CHUNK]
        lo = start + a
        wanted = max(0, lo + len(chunk) - max(first_logit, lo))
        logits = runtime.decode([DecodeChunk(0, chunk, lo, wanted)])[0]
        if wanted:
            rows.append(np.array(logits, dtype=np.float64))
    return np.concatenate(rows) if rows else np.zeros((0, runtime.info.vocab_size))


def next_token_logits(runtime: ModelRuntime, prefix: list[int]) -> npt.NDArray[np.float64]:
    """The target's logits for the token after ``prefix`` (a fresh prefill on slot 0)."""
    runtime.free(0)
    try:
        logits: npt.NDArray[np.float64] = _decode_all(runtime, prefix, 0, len(prefix) - 1)[-1]
        return logits
    finally:
        runtime.free(0)


def output_logprobs(
    runtime: ModelRuntime, prompt_ids: list[int], outputs: list[list[int]]
) -> list[npt.NDArray[np.float64]]:
    """Per output, ``log p(output[j] | prompt + output[:j])`` under the raw (temperature 1) target.

    The prompt is prefilled once; each output is appended after it and rolled back with a truncate.
    """
    runtime.free(0)
    base = len(prompt_ids) - 1
    try:
        if base:
            _decode_all(runtime, prompt_ids[:-1], 0, base + 1)  # no logits
        scores = []
        for output in outputs:
            if not output:
                scores.append(np.zeros(0))
                continue
            logits = _decode_all(runtime, [prompt_ids[-1], *output[:-1]], base, base)
            shifted = logits - logits.max(axis=1, keepdims=True)
            log_norm = np.log(np.exp(shifted).sum(axis=1))
            scores.append(shifted[np.arange(len(output)), output] - log_norm)
            runtime.truncate(0, base)
        return scores
    finally:
        runtime.free(0)
