"""Training data for a block drafter: the target's own responses to a prompt file, with its hidden states.

The target answers every prompt (chat template, greedy unless told otherwise) on specserve's own engine,
plain decoding, many sequences at once. Its passes already evaluate every token of prompt and response,
so the features come for free: a recorder behind the engine's ``committed`` hook (the one a block drafter
reads) keeps each sequence's captured layer outputs. The last token of a response is never evaluated;
an example's features therefore cover its tokens but the last.

The dataset is saved next to the checkpoints (``data.pt``), so a resumed run does not generate it again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.backends.torch.dflash2 import TargetFeatures
from specserve.chat import chat_prompt_ids
from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.engine.builder import flat_costs
from specserve.engine.cost_model import CostModel
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.options import EngineOptions
from specserve.request import SamplingParams
from specserve.sequence import Sequence
from specserve.tools.workloads import ToolInputError


@dataclass
class Example:
    tokens: torch.Tensor  # [T] int64: prompt then response
    features: torch.Tensor  # [T - 1, layers × hidden]: the target's features of tokens 0 … T - 2
    prompt_len: int


def read_prompts(path: Path) -> list[str]:
    """A JSONL file of ``{"prompt": …}`` objects, or plain text with one prompt per line."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise ToolInputError(f"--prompts {path}: {exc.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("{"):
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise ToolInputError(f'--prompts {path}:{number}: expected {{"prompt": …}}') from None
        else:
            prompts.append(line)
    if not prompts:
        raise ToolInputError(f"--prompts {path}: no prompts")
    return prompts


class FeatureRecorder(Drafter):
    """Never drafts; keeps the features of every committed row of the sequences it is told about."""

    name = "feature-recorder"
    reads_target_states = True

    def __init__(self, target: Any, features: TargetFeatures) -> None:
        self.target, self.features = target, features
        self.rows: dict[str, list[torch.Tensor]] = {}

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        return DraftOption(0)

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        return [Proposal([]) for _ in seqs]

    def committed(self, seq: Sequence, chunk: int, start: int, count: int) -> None:
        kept = self.rows.setdefault(seq.request_id, [])
        assert sum(r.shape[0] for r in kept) == start, "the target evaluated a sequence out of order"
        kept.append(self.features(self.target.hidden[chunk][:count]).cpu())


def generate_examples(
    target: Any,
    features: TargetFeatures,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 0.0,
    progress: Callable[[int, int], None] = lambda _done, _total: None,
) -> list[Example]:
    """The target's responses to ``prompts`` (a plain engine over ``target``, all its slots at once)."""
    recorder = FeatureRecorder(target, features)
    target.capture_layers = features.capture
    engine = SpeculativeEngine(
        target,
        {recorder.name: recorder},
        FixedLengthPolicy(),
        CostModel(flat_costs()),  # plain decoding consults no costs
        EngineOptions((), 0, speculation_enabled=False),
    )
    params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=0)
    sequences = []
    for i, prompt in enumerate(prompts):
        ids = chat_prompt_ids(target, [{"role": "user", "content": prompt}])
        ids = ids[: target.info.context_per_sequence - max_new_tokens - 1]
        sequences.append(engine.add_request(f"train-{i}", ids, params))
    done = 0
    while engine.has_work():
        for output in engine.step():
            if output.finished:
                done += 1
                progress(done, len(prompts))
    target.capture_layers = ()
    examples = []
    for seq in sequences:
        rows = recorder.rows.get(seq.request_id, [])
        tokens = seq.tokens
        if not rows or seq.finish_reason == "error" or len(seq.output_ids) < 2:
            continue
        feats = torch.cat(rows)[: len(tokens) - 1]
        examples.append(Example(torch.tensor(tokens[: feats.shape[0] + 1]), feats, len(seq.prompt_ids)))
    return examples


def save_examples(examples: list[Example], path: Path, recorded_with: dict[str, Any]) -> None:
    """``recorded_with``: what the features depend on (the target layers read), checked on reuse."""
    rows = [{"tokens": e.tokens, "features": e.features, "prompt_len": e.prompt_len} for e in examples]
    partial = path.with_suffix(".partial")
    torch.save({"recorded_with": recorded_with, "examples": rows}, partial)
    partial.replace(path)


def load_examples(path: Path) -> tuple[list[Example], dict[str, Any]]:
    """The examples and what they were recorded with."""
    payload = torch.load(path, weights_only=True)
    rows = payload["examples"]
    return [Example(p["tokens"], p["features"], int(p["prompt_len"])) for p in rows], payload["recorded_with"]
