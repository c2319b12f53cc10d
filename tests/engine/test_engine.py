"""End-to-end engine invariants on tiny real models (llama.cpp backend, exact mode).

The central one: under greedy decoding, speculative output equals plain output token for token, for every
drafter and draft length, alone or batched with other sequences.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from specserve.backends.base import HostLogits
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.drafters.base import Drafter
from specserve.drafters.draft_model import DraftModelDrafter
from specserve.drafters.ngram import NgramDrafter
from specserve.drafters.suffix import SuffixDrafter
from specserve.engine.cost_model import CostModel, StepCostTable, calibrate
from specserve.engine.cost_policy import CostAwarePolicy
from specserve.engine.draft_policy import DraftLengthPolicy, FixedLengthPolicy
from specserve.engine.engine import SpeculativeEngine
from specserve.engine.offline import OfflineEngine
from specserve.engine.options import EngineOptions
from specserve.engine.output_processor import RequestState
from specserve.request import SamplingParams
from specserve.sequence import SpeculationOptions
from specserve.verify import VerifyRequest
from specserve.verify.host import HostVerifier
from support.distribution import assert_follows, exact_pairs
from support.faulty_drafter import ExplodingDrafter
from support.tiny_models import TinyModels

PROMPT = "def add(self, other):\n    return self.value + other.value\n" * 2


def _runtime(path: Path, context: int = 512, max_sequences: int = 4) -> LlamaCppRuntime:
    return LlamaCppRuntime(path, context_per_sequence=context, max_sequences=max_sequences, n_threads=1)


@contextmanager
def make_engine(
    models: TinyModels,
    draft: Path | None = None,
    k: int = 4,
    policy: DraftLengthPolicy | None = None,
    context: int = 512,
    extra: dict[str, Drafter] | None = None,
) -> Iterator[SpeculativeEngine]:
    target = _runtime(models.target, context)
    drafters: dict[str, Drafter] = {
        "ngram": NgramDrafter(),
        "suffix": SuffixDrafter(min_prob=0.0, factor=4.0),
    }
    if draft is not None:
        drafters["draft-model"] = DraftModelDrafter(_runtime(draft, context), p_min=0.0)
    drafters.update(extra or {})
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 64: 64.0}))
    engine = SpeculativeEngine(
        target, drafters, policy or FixedLengthPolicy(), costs, EngineOptions(tuple(drafters), k)
    )
    try:
        yield engine
    finally:
        engine.close()


def run_all(
    engine: SpeculativeEngine, requests: list[tuple[str, SamplingParams, str | None]]
) -> list[RequestState]:
    """The requests' outputs as a client gets them (text and stop strings by the output processor)."""
    offline = OfflineEngine(engine)
    states = []
    for i, (prompt, params, drafter) in enumerate(requests):
        ids = engine.target.tokenize(prompt)
        states.append(offline.add_request(f"r{i}", ids, params, SpeculationOptions(drafter=drafter)))
    offline.run()
    return states


def generate(
    models: TinyModels, params: SamplingParams, drafter: str | None = "none", **kw: object
) -> RequestState:
    with make_engine(models, **kw) as engine:  # type: ignore[arg-type]
        return run_all(engine, [(PROMPT, params, drafter)])[0]


GREEDY = SamplingParams(max_tokens=48)


@pytest.fixture(scope="module")
def plain_greedy(tiny_models: TinyModels) -> RequestState:
    return generate(tiny_models, GREEDY)


@pytest.mark.parametrize("k", [1, 3, 8, 16])
@pytest.mark.parametrize("which", ["draft", "draft_close", "target"])
def test_greedy_draft_model_equals_plain(
    tiny_models: TinyModels, plain_greedy: RequestState, which: str, k: int
) -> None:
    seq = generate(tiny_models, GREEDY, "draft-model", draft=getattr(tiny_models, which), k=k)
    assert seq.output_ids == plain_greedy.output_ids
    assert seq.text == plain_greedy.text
    assert seq.stats.num_drafts > 0
    assert seq.stats.num_accepted_tokens <= seq.stats.num_draft_tokens


def test_self_draft_accepts_everything(tiny_models: TinyModels) -> None:
    for params in (GREEDY, SamplingParams(max_tokens=48, temperature=0.9, top_k=30, top_p=0.95, seed=5)):
        seq = generate(tiny_models, params, "draft-model", draft=tiny_models.target, k=6)
        assert seq.stats.num_draft_tokens > 20
        assert seq.stats.acceptance_rate >= 0.98


def test_partial_acceptance_rolls_back_exactly(tiny_models: TinyModels, plain_greedy: RequestState) -> None:
    seq = generate(tiny_models, GREEDY, "draft-model", draft=tiny_models.draft_close, k=8)
    assert seq.output_ids == plain_greedy.output_ids
    assert 0 < seq.stats.num_accepted_tokens < seq.stats.num_draft_tokens  # some drafts were rolled back
    assert seq.stats.first_rejections


def test_ngram_greedy_equals_plain_with_copyable_output(tiny_models: TinyModels) -> None:
    # Feed the model's own greedy continuation back in the prompt, so prompt lookup finds long matches.
    first = generate(tiny_models, SamplingParams(max_tokens=40))
    with make_engine(tiny_models, k=8) as engine:
        prompt = PROMPT + first.text
        plain, spec = run_all(engine, [(prompt, GREEDY, "none"), (prompt, GREEDY, "ngram")])
    assert spec.output_ids == plain.output_ids
    assert spec.stats.num_drafts > 0


@pytest.mark.parametrize("k", [1, 4, 16])
def test_suffix_greedy_equals_plain_and_drafts_from_earlier_outputs(
    tiny_models: TinyModels, plain_greedy: RequestState, k: int
) -> None:
    """The same request three times (an agent re-running a task): the suffix drafter copies the earlier
    outputs, and every run equals plain decoding token for token."""
    with make_engine(tiny_models, k=k) as engine:
        runs = [run_all(engine, [(PROMPT, GREEDY, "suffix")])[0] for _ in range(3)]
        assert engine.drafters["suffix"].cache.num_requests == 3  # type: ignore[attr-defined]
    for seq in runs:
        assert seq.output_ids == plain_greedy.output_ids
    assert runs[2].stats.num_accepted_tokens > runs[0].stats.num_accepted_tokens
    assert runs[2].stats.acceptance_rate > 0.9  # a greedy re-run copies its predecessors exactly
    assert runs[2].stats.num_accepted_tokens >= len(plain_greedy.output_ids) * k / (k + 1) - k - 1


def test_suffix_sampled_output_follows_the_target_distribution(tiny_models: TinyModels) -> None:
    """Sampled requests of one prompt, the suffix drafter copying earlier requests' outputs: the first two
    tokens follow the target's own distribution with temperature, top-k, top-p and min-p applied."""
    knobs: dict[str, Any] = {"temperature": 0.8, "top_k": 4, "top_p": 0.95, "min_p": 0.02}
    n = 1500
    with make_engine(tiny_models, k=3) as engine:
        prompt = engine.target.tokenize(PROMPT)
        expected = exact_pairs(engine.target, 0, prompt, knobs)
        produced: dict[str, list[int]] = {}
        for seed in range(n):
            params = SamplingParams(max_tokens=3, seed=seed, **knobs)
            engine.add_request(f"s{seed}", prompt, params, SpeculationOptions(drafter="suffix"))
            while engine.scheduler.waiting or len(engine.scheduler.running) >= 4:
                for out in engine.step():
                    produced.setdefault(out.request_id, []).extend(out.new_token_ids)
        while engine.has_work():
            for out in engine.step():
                produced.setdefault(out.request_id, []).extend(out.new_token_ids)
        stats = engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts accepted and rejected
    counts = Counter((tokens[0], tokens[1]) for tokens in produced.values())
    assert_follows(counts, expected, n, max_tv=0.04)


def test_batched_sequences_match_solo_runs(tiny_models: TinyModels, plain_greedy: RequestState) -> None:
    prompts = [PROMPT, "import numpy as np\n", "class Foo:\n    def __init__(self):"]
    solo = [generate(tiny_models, GREEDY, "none").output_ids]
    with make_engine(tiny_models) as engine:
        solo += [run_all(engine, [(p, GREEDY, "none")])[0].output_ids for p in prompts[1:]]
    with make_engine(tiny_models, draft=tiny_models.draft_close, k=5) as engine:
        drafters = ["draft-model", "ngram", "suffix"]
        batched = run_all(engine, [(p, GREEDY, d) for p, d in zip(prompts, drafters, strict=True)])
    assert [s.output_ids for s in batched] == solo
    assert solo[0] == plain_greedy.output_ids


def test_sampling_is_seeded_and_drafter_independent_for_model_free_drafts(tiny_models: TinyModels) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=11)
    plain = generate(tiny_models, params)
    again = generate(tiny_models, params)
    assert plain.output_ids == again.output_ids
    # Positional coupling: one uniform per output position, so n-gram drafts do not change the sample.
    with make_engine(tiny_models, k=8) as engine:
        prompt = PROMPT + plain.text
        base, spec, suffix = run_all(
            engine, [(prompt, params, "none"), (prompt, params, "ngram"), (prompt, params, "suffix")]
        )
    assert spec.output_ids == base.output_ids == suffix.output_ids
    other = generate(tiny_models, SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=12))
    assert other.output_ids != plain.output_ids


def test_draft_model_sampling_is_deterministic_for_a_seed(tiny_models: TinyModels) -> None:
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=3)
    a = generate(tiny_models, params, "draft-model", draft=tiny_models.draft_close, k=4)
    b = generate(tiny_models, params, "draft-model", draft=tiny_models.draft_close, k=4)
    assert a.output_ids == b.output_ids and a.stats.num_drafts > 0


def test_stop_string_inside_accepted_run(tiny_models: TinyModels, plain_greedy: RequestState) -> None:
    text = plain_greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), "pick a visible stop string"
    expected = text[: text.index(stop)]
    params = SamplingParams(max_tokens=48, stop=(stop,))
    plain = generate(tiny_models, params)
    spec = generate(tiny_models, params, "draft-model", draft=tiny_models.target, k=16)
    assert plain.text == expected and spec.text == expected
    assert spec.output_ids == plain.output_ids
    assert spec.finish_reason == plain.finish_reason == "stop"
    assert spec.stats.num_accepted_tokens > 0


def test_max_tokens_and_context_limit_stop_where_plain_stops(tiny_models: TinyModels) -> None:
    for max_tokens in (1, 2, 7):
        params = SamplingParams(max_tokens=max_tokens)
        plain = generate(tiny_models, params)
        spec = generate(tiny_models, params, "draft-model", draft=tiny_models.target, k=16)
        assert len(plain.output_ids) == max_tokens and spec.output_ids == plain.output_ids
        assert spec.finish_reason == "length"
    long_params = SamplingParams(max_tokens=500)
    plain = generate(tiny_models, long_params, context=96)
    spec = generate(tiny_models, long_params, "draft-model", draft=tiny_models.target, k=16, context=96)
    assert len(plain.prompt_ids) + len(plain.output_ids) == 96 and spec.output_ids == plain.output_ids
    assert spec.finish_reason == plain.finish_reason == "length"


def test_prompt_too_long_or_empty_is_rejected(tiny_models: TinyModels) -> None:
    with make_engine(tiny_models, context=32) as engine:
        with pytest.raises(ValueError, match="context holds 32"):
            engine.add_request("x", list(range(40)), GREEDY)
        with pytest.raises(ValueError, match="empty"):
            engine.add_request("y", [], GREEDY)
        with pytest.raises(ValueError, match="not available"):
            engine.add_request("z", [1, 2], GREEDY, SpeculationOptions(drafter="nope"))


def test_abort_frees_the_slot_and_others_continue(
    tiny_models: TinyModels, plain_greedy: RequestState
) -> None:
    with make_engine(tiny_models, draft=tiny_models.draft_close) as engine:
        ids = engine.target.tokenize(PROMPT)
        keep = engine.add_request("keep", ids, GREEDY, SpeculationOptions(drafter="draft-model"))
        drop = engine.add_request("drop", ids, SamplingParams(max_tokens=400))
        for _ in range(3):
            engine.step()
        assert engine.abort("drop") and drop.finish_reason == "abort"
        assert not engine.abort("drop")
        while engine.has_work():
            engine.step()
        assert keep.output_ids == plain_greedy.output_ids
        assert engine.scheduler.num_free_slots == engine.target.info.max_sequences


def test_a_request_that_fails_in_the_engine_fails_alone(
    tiny_models: TinyModels, plain_greedy: RequestState
) -> None:
    """The batched verifier fails on a step that holds the bad request: the engine verifies each sequence
    alone, so only that request ends (``error``, its KV freed) and the other's output is unchanged."""
    bad_params = SamplingParams(max_tokens=400)

    class FlakyVerifier(HostVerifier):
        calls = 0

        def verify(self, target_logits: HostLogits, requests: Seq[VerifyRequest]) -> list[list[int]]:
            self.calls += 1
            if self.calls >= 3 and any(r.params is bad_params for r in requests):
                raise RuntimeError("injected failure")
            return super().verify(target_logits, requests)

    with make_engine(tiny_models) as engine:
        engine.verifier = FlakyVerifier()
        ids = engine.target.tokenize(PROMPT)
        good = engine.add_request("good", ids, GREEDY, SpeculationOptions(drafter="ngram"))
        bad = engine.add_request("bad", ids, bad_params)
        outputs = []
        while engine.has_work():
            outputs += engine.step()
        assert bad.finish_reason == "error" and any(o.request_id == "bad" and o.finished for o in outputs)
        assert good.output_ids == plain_greedy.output_ids
        assert engine.scheduler.num_free_slots == engine.target.info.max_sequences


def test_failing_drafter_falls_back_to_plain_output(
    tiny_models: TinyModels, plain_greedy: RequestState
) -> None:
    exploding = ExplodingDrafter()
    with make_engine(tiny_models, extra={"exploding": exploding}) as engine:
        seq = run_all(engine, [(PROMPT, GREEDY, "exploding")])[0]
        assert engine.stats.drafter_failures == 3
        assert "exploding" not in engine.drafters  # disabled after repeated failures
    assert seq.output_ids == plain_greedy.output_ids


def test_a_failing_suffix_drafter_degrades_to_plain_decoding(
    tiny_models: TinyModels, plain_greedy: RequestState, monkeypatch: pytest.MonkeyPatch
) -> None:
    with make_engine(tiny_models) as engine:
        run_all(engine, [(PROMPT, GREEDY, "suffix")])  # its output is now in the cache
        suffix = engine.drafters["suffix"]

        def broken(*_args: object) -> list[object]:
            raise RuntimeError("simulated index fault")

        monkeypatch.setattr(suffix, "_occurrences", broken)
        seq = run_all(engine, [(PROMPT, GREEDY, "suffix")])[0]
        assert engine.stats.drafter_failures == 3 and "suffix" not in engine.drafters
        assert not suffix.cache._live  # type: ignore[attr-defined]  # the failed requests' state is gone
    assert seq.output_ids == plain_greedy.output_ids


def test_cost_aware_policy_keeps_exactness(tiny_models: TinyModels, plain_greedy: RequestState) -> None:
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 16: 1.2, 64: 4.0}))  # GPU-like: drafting pays
    seq = generate(
        tiny_models, GREEDY, "draft-model", draft=tiny_models.target, k=8, policy=CostAwarePolicy(costs)
    )
    assert seq.output_ids == plain_greedy.output_ids
    assert seq.stats.num_drafts > 0


def test_one_verifier_call_per_step_covers_every_emitting_sequence(tiny_models: TinyModels) -> None:
    """The seam a device runtime plugs into: the engine hands the verifier the step's logits rows as the
    runtime left them, once per step, with one request per sequence that emits."""
    calls: list[tuple[int, int]] = []  # (rows, requests)

    class CountingVerifier(HostVerifier):
        def verify(self, target_logits: HostLogits, requests: Seq[VerifyRequest]) -> list[list[int]]:
            calls.append((target_logits.shape[0], len(requests)))
            return super().verify(target_logits, requests)

    with make_engine(tiny_models) as engine:
        engine.verifier = CountingVerifier()
        ids = engine.target.tokenize(PROMPT)
        seqs = [
            engine.add_request(f"r{i}", ids, GREEDY, SpeculationOptions(drafter="ngram")) for i in range(3)
        ]
        steps = 0
        while engine.has_work():
            outputs = engine.step()
            steps += 1
            assert len(calls) == steps, "one verifier call per step"
            assert calls[-1][1] == len({o.request_id for o in outputs}) >= 1
        assert all(s.finish_reason == "length" for s in seqs)
        assert calls[0][0] == 3 and max(rows for rows, _ in calls) > 3  # first tokens, then drafts


def test_last_pass_reports_the_steps_rows(tiny_models: TinyModels) -> None:
    with make_engine(tiny_models, k=4) as engine:
        ids = engine.target.tokenize(PROMPT)
        seq = engine.add_request("r", ids, GREEDY, SpeculationOptions(drafter="ngram"))
        rows = []
        while engine.has_work():
            drafts, decoding = seq.stats.num_draft_tokens, bool(seq.output_ids)
            engine.step()
            assert engine.last_pass.seconds > 0
            if decoding:
                rows.append((engine.last_pass.rows, seq.stats.num_draft_tokens - drafts))
    # A decoding step's pass holds the pending token and the drafts verified in it.
    assert any(d > 0 for _, d in rows) and all(r == 1 + d for r, d in rows)


def test_a_step_of_several_passes_does_not_refine_the_cost_table(tiny_models: TinyModels) -> None:
    """Two sequences with different rows run as two passes in llama.cpp (one KV stream each): the step's
    time is not what one pass of its rows costs, so the table learns only from steps of one pass."""
    with make_engine(tiny_models, k=4) as engine:
        engine.costs.target = calibrate(engine.target, scratch_seq=3)  # within 3x of what a step takes
        ids = engine.target.tokenize(PROMPT)
        a = engine.add_request("a", ids, GREEDY, SpeculationOptions(drafter="ngram"))
        b = engine.add_request("b", ids, GREEDY, SpeculationOptions(drafter="none"))
        learned: dict[int, list[bool]] = {1: [], 2: []}
        while engine.has_work():
            decoding = all(s.output_ids and not s.finished for s in (a, b))
            drafts, seen = a.stats.num_draft_tokens, engine.costs.target.observations
            engine.step()
            if decoding:
                rows = [1 + a.stats.num_draft_tokens - drafts, 1]
                passes = len(engine.target.call_rows(rows, [a.slot, b.slot]))
                learned[passes].append(engine.costs.target.observations > seen)
    assert learned[2] and not any(learned[2])
    assert any(learned[1])  # (not all: a step more than 3x off its price is an outlier, on a busy machine)


def test_auto_asks_the_suffix_drafter_where_it_covers_the_ngram_drafter(
    tiny_models: TinyModels, plain_greedy: RequestState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``auto`` the n-gram drafter is not asked while the suffix drafter is loaded (it makes every
    draft the n-gram drafter would, priced per token); a request naming it still gets it, and once the
    suffix drafter is disabled ``auto`` falls back to it."""
    with make_engine(tiny_models) as engine:
        run_all(engine, [(PROMPT, GREEDY, None), (PROMPT, GREEDY, "ngram")])
        assert engine.stats.drafts_by_drafter["suffix"] > 0
        assert engine.stats.drafts_by_drafter["ngram"] > 0  # the request that named it
        ngram_drafts = engine.stats.drafts_by_drafter["ngram"]
        run_all(engine, [(PROMPT, GREEDY, None)])
        assert engine.stats.drafts_by_drafter["ngram"] == ngram_drafts  # not asked under auto

        def broken(*_args: object) -> list[object]:
            raise RuntimeError("simulated index fault")

        monkeypatch.setattr(engine.drafters["suffix"], "_occurrences", broken)
        (seq,) = run_all(engine, [(PROMPT, GREEDY, None)])
        assert "suffix" not in engine.drafters
        assert engine.stats.drafts_by_drafter["ngram"] > ngram_drafts
    assert seq.output_ids == plain_greedy.output_ids
