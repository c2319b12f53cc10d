"""Penalties, logit_bias, stop_token_ids, grammars and logprobs through the engine, on tiny real models.

Greedy output with speculation equals plain output token for token under every knob (each verified row is
changed as plain decoding changes it at that position); grammar-constrained output is always valid; logprobs
do not depend on speculation.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence as Seq
from pathlib import Path

import jsonschema
import pytest

from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.drafters.base import Drafter, DraftOption, Proposal
from specserve.drafters.draft_model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.suffix import SuffixDrafter
from specserve.engine.cost_model import CostModel, StepCostTable
from specserve.engine.draft_policy import FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.offline import OfflineEngine
from specserve.engine.options import EngineOptions
from specserve.engine.output_processor import RequestState
from specserve.request import GrammarSpec, SamplingParams
from specserve.sequence import Sequence, SpeculationOptions
from specserve.verify.logprobs import TokenLogprobs
from support.tiny_models import TinyModels

PROMPT = "def add(self, other):\n    return self.value + other.value\n" * 2

KNOBS = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"repetition_penalty": 1.8},
    {"logit_bias": ((40, 8.0), (41, -100.0))},
    {"frequency_penalty": 0.7, "presence_penalty": -0.5, "repetition_penalty": 1.3},
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}


def _run(
    models: TinyModels, params: SamplingParams, drafter: str, logprobs: list[TokenLogprobs] | None = None
) -> RequestState:
    """One request on a fresh engine (exact mode, fixed 4-token drafts, n-gram and close draft model);
    its outputs' logprobs go to ``logprobs``."""
    logprobs = [] if logprobs is None else logprobs

    def runtime(path: Path) -> LlamaCppRuntime:
        return LlamaCppRuntime(path, context_per_sequence=512, max_sequences=2, n_threads=1)

    drafters: dict[str, Drafter] = {
        "ngram": NgramDrafter(),
        "suffix": SuffixDrafter(min_prob=0.0, factor=4.0),
        "draft-model": DraftModelDrafter(runtime(models.draft_close), p_min=0.0),
    }
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 64: 64.0}))
    options = EngineOptions(tuple(drafters), 4)
    engine = SpeculativeEngine(runtime(models.target), drafters, FixedLengthPolicy(), costs, options)
    try:
        offline = OfflineEngine(engine)
        ids = engine.target.tokenize(PROMPT)
        request = offline.add_request("r0", ids, params, SpeculationOptions(drafter=drafter))
        while offline.has_work():
            for out in offline.step():
                logprobs.extend(out.new_logprobs)
        return request
    finally:
        engine.close()


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(k))
def test_penalised_greedy_speculation_equals_plain(tiny_models: TinyModels, knobs: dict[str, object]) -> None:
    params = SamplingParams(max_tokens=48, ignore_eos=True, **knobs)  # type: ignore[arg-type]
    plain = _run(tiny_models, params, "none")
    unpenalised = _run(tiny_models, SamplingParams(max_tokens=48, ignore_eos=True), "none")
    assert plain.output_ids != unpenalised.output_ids  # the knob changes the answer
    for drafter in ("ngram", "suffix", "draft-model"):
        spec = _run(tiny_models, params, drafter)
        assert spec.output_ids == plain.output_ids, drafter
        if drafter == "draft-model":  # (prompt lookup finds little to copy in penalised output)
            assert spec.stats.num_drafts > 0 and spec.stats.num_accepted_tokens > 0


def test_stop_token_ids_end_the_output_without_emitting(tiny_models: TinyModels) -> None:
    free = _run(tiny_models, SamplingParams(max_tokens=32, ignore_eos=True), "none")
    stop = free.output_ids[10]
    first = free.output_ids.index(stop)
    for drafter in ("none", "ngram", "suffix", "draft-model"):
        seq = _run(
            tiny_models, SamplingParams(max_tokens=32, ignore_eos=True, stop_token_ids=(stop,)), drafter
        )
        assert seq.output_ids == free.output_ids[:first] and seq.finish_reason == "stop"


def test_schema_constrained_output_validates_and_speculation_is_exact(tiny_models: TinyModels) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=200, grammar=spec)
    plain = _run(tiny_models, params, "none")
    jsonschema.validate(json.loads(plain.text), SCHEMA)
    assert plain.finish_reason == "stop"
    for drafter in ("auto", "ngram", "suffix", "draft-model"):
        seq = _run(tiny_models, params, drafter)
        assert seq.output_ids == plain.output_ids, drafter
        assert seq.stats.drafts_by_drafter.get("grammar", 0) > 0


@pytest.mark.parametrize("seed", range(4))
def test_sampled_constrained_output_always_validates(tiny_models: TinyModels, seed: int) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, grammar=spec, frequency_penalty=0.5)
    seq = _run(tiny_models, params, "auto")
    jsonschema.validate(json.loads(seq.text), SCHEMA)


@pytest.mark.parametrize(
    ("kind", "text", "check"),
    [
        ("regex", r"[0-9]{3}-[a-z]{2,4}", r"^[0-9]{3}-[a-z]{2,4}$"),
        ("choice", json.dumps(["alpha", "beta", "gamma delta"]), r"^(alpha|beta|gamma delta)$"),
        ("grammar", 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/', r"^x=[1-9][0-9]?;$"),
        ("json_object", "", r"^\{.*\}$"),
    ],
)
def test_other_grammar_kinds(tiny_models: TinyModels, kind: str, text: str, check: str) -> None:
    seq = _run(tiny_models, SamplingParams(max_tokens=120, grammar=GrammarSpec(kind, text)), "auto")
    assert re.match(check, seq.text, re.S), seq.text
    if kind == "json_object":
        assert isinstance(json.loads(seq.text), dict)


def test_logprobs_do_not_depend_on_speculation(tiny_models: TinyModels) -> None:
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=3)
    plain_logprobs: list[TokenLogprobs] = []
    plain = _run(tiny_models, params, "none", plain_logprobs)
    assert len(plain_logprobs) == len(plain.output_ids)
    for drafter in ("ngram", "suffix", "draft-model"):
        spec_logprobs: list[TokenLogprobs] = []
        spec = _run(tiny_models, params, drafter, spec_logprobs)
        assert spec.output_ids == plain.output_ids
        assert spec_logprobs == plain_logprobs, drafter
    first = plain_logprobs[0]
    assert isinstance(first, TokenLogprobs)
    assert first.token_id == plain.output_ids[0] and first.top[0][0] == first.token_id  # greedy: the top one
    assert len(first.top) == 3 and first.top[0][1] >= first.top[1][1] >= first.top[2][1]


@pytest.mark.parametrize(("kind", "text"), [("regex", ""), ("choice", '[""]')])
def test_a_grammar_that_allows_only_the_empty_string_ends_at_once(
    tiny_models: TinyModels, kind: str, text: str
) -> None:
    for drafter in ("none", "auto"):
        seq = _run(tiny_models, SamplingParams(max_tokens=20, grammar=GrammarSpec(kind, text)), drafter)
        assert seq.output_ids == [] and seq.finish_reason == "stop"


class _Scripted(Drafter):
    """Proposes a fixed continuation of the prompt (what a draft model that knows the answer would)."""

    name = "scripted"

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def available(self, seq: Sequence, limit: int) -> DraftOption:
        return DraftOption(min(limit, len(self.script) - len(seq.output_ids)))

    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        return [
            Proposal(self.script[len(s.output_ids) : len(s.output_ids) + n])
            for s, n in zip(seqs, num_tokens, strict=True)
        ]


@pytest.mark.parametrize("ends", [1, 2, 3])
def test_drafted_ends_after_a_complete_grammar_keep_it_in_step(tiny_models: TinyModels, ends: int) -> None:
    """A draft that completes the grammar followed by end-of-generation drafts: the end is never consumed
    by the matcher (it would not record it, and the rollback would undo a committed token)."""
    spec = GrammarSpec("json_object")  # its closing brace is not forced: the scripted drafter drafts it
    plain = _run(tiny_models, SamplingParams(max_tokens=200, grammar=spec), "none")
    assert plain.finish_reason == "stop"
    runtime = LlamaCppRuntime(tiny_models.target, context_per_sequence=512, max_sequences=2, n_threads=1)
    eos = next(t for t in range(runtime.info.vocab_size) if runtime.is_eog(t))
    drafter = _Scripted([*plain.output_ids, *[eos] * ends])
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 64: 64.0}))
    engine = SpeculativeEngine(
        runtime, {"scripted": drafter}, FixedLengthPolicy(), costs, EngineOptions(("scripted",), 8)
    )
    try:
        seq = engine.add_request("r", runtime.tokenize(PROMPT), SamplingParams(max_tokens=200, grammar=spec))
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    assert seq.finish_reason == "stop" and seq.output_ids == plain.output_ids


def test_a_grammar_that_fails_mid_request_fails_only_that_request(tiny_models: TinyModels) -> None:
    """An ambiguous grammar past llguidance's limits: that request ends with 'error', the other goes on."""
    runtime = LlamaCppRuntime(tiny_models.target, context_per_sequence=512, max_sequences=2, n_threads=1)
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 64: 64.0}))
    engine = SpeculativeEngine(
        runtime, {"ngram": NgramDrafter()}, FixedLengthPolicy(), costs, EngineOptions(("ngram",), 8)
    )
    try:
        ids = runtime.tokenize(PROMPT)
        bad = engine.add_request(
            "bad",
            ids,
            SamplingParams(
                max_tokens=400,
                ignore_eos=True,
                grammar=GrammarSpec("grammar", 'start: x\nx: "a" | x x | x x x'),
            ),
        )
        good = engine.add_request("good", ids, SamplingParams(max_tokens=60, ignore_eos=True))
        while engine.has_work():
            engine.step()
    finally:
        engine.close()
    assert bad.finish_reason == "error" and good.finish_reason == "length"
    assert len(good.output_ids) == 60


def _trigger_window(text: str) -> int:
    """The first offset from 8 on where 4 plain ASCII characters occur for the first time in ``text``."""
    for i in range(8, len(text) - 4):
        window = text[i : i + 4]
        if all(c.isascii() and c.isprintable() and c not in '"\\' for c in window) and text.find(window) == i:
            return i
    raise AssertionError(f"no plain 4-character window in {text!r}")


def test_a_lazy_grammar_is_free_until_its_trigger_and_exact_with_speculation(tiny_models: TinyModels) -> None:
    """Before the trigger the output is the unconstrained one; from the trigger's start on the grammar's; and
    drafts that cross the trigger are verified under exactly the masks plain decoding applies."""
    free = _run(tiny_models, SamplingParams(max_tokens=40, ignore_eos=True), "none").text
    at = _trigger_window(free)
    trigger = free[at : at + 4]
    grammar = f"start: {json.dumps(trigger)} DIGITS\nDIGITS: /[0-9]{{1,12}}/\n"
    params = SamplingParams(
        max_tokens=80, grammar=GrammarSpec("grammar", grammar, triggers=(re.escape(trigger),))
    )
    plain = _run(tiny_models, params, "none")
    assert plain.text.startswith(free[: at + 4])
    assert re.fullmatch(r"[0-9]{1,12}", plain.text[at + 4 :]), plain.text
    assert plain.finish_reason == "stop"
    for drafter in ("ngram", "suffix", "draft-model"):
        seq = _run(tiny_models, params, drafter)
        assert seq.output_ids == plain.output_ids, drafter
        assert seq.stats.num_drafts > 0
