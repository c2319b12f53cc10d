"""The real engine on the torch runtime: speculative output equals plain output, token for token.

Greedy for both drafters (n-gram and the draft model, also torch), with prefix-cache hits on the second
round; seeded sampling with n-gram drafts (one-hot drafts with position-coupled uniforms emit what plain
sampling emits).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

from specserve.config import Settings
from specserve.engine.builder import LoadedModels, load_models
from specserve.request import SamplingParams
from support.tiny_models import TinyModels

CODE = "def check(values):\n    return [value * 2 for value in values if value]\n"


@pytest.fixture(
    scope="module",
    params=[
        ("float32", "masked"),
        ("bfloat16", "masked"),
        pytest.param(("float32", "rows"), marks=pytest.mark.slow),  # interpreted: minutes
    ],
    ids=["fp32", "bf16", "fp32-rows"],
)
def models(tiny_models: TinyModels, request: pytest.FixtureRequest) -> Iterator[LoadedModels]:
    """The CPU's attention in both dtypes, and the GPU's row attention (Triton, interpreted here)."""
    dtype, attention = request.param
    settings = Settings(
        dtype=dtype,
        attention=attention,
        target=str(tiny_models.target),
        draft=str(tiny_models.draft_close),
        backend="torch",
        device="cpu",
        threads=1,
        context_size=512,
        max_running=4,
        load_draft="always",
        calibration_cache=False,
    ).validate()
    loaded = load_models(settings, calibrate_costs=False, keep_draft=True)
    yield loaded
    loaded.close()


Outputs = list[list[list[int]]]
"""Per round, per request: the emitted token ids."""


def run(
    models: LoadedModels, drafters: tuple[str, ...], params: SamplingParams, rounds: int = 2
) -> tuple[Outputs, int, int]:
    """Three requests sharing a prefix, ``rounds`` times; returns outputs, drafts and accepted tokens."""
    engine = models.engine(
        drafters=drafters, policy=models.policy("fixed"), num_draft_tokens=4, prefix_cache=True
    )
    prompt = models.target.tokenize(CODE * 3)
    outputs: Outputs = []
    for r in range(rounds):
        for i in range(3):
            engine.add_request(f"{r}-{i}", prompt[: 24 + 9 * i], params)
        produced: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step():
                produced.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs.append([produced[f"{r}-{i}"] for i in range(3)])
    assert engine.prefix_cache is not None
    assert rounds == 1 or engine.prefix_cache.stats.hits > 0
    stats = engine.stats
    return outputs, stats.num_drafts, stats.num_accepted_tokens


def test_runtime_is_torch(models: LoadedModels) -> None:
    assert type(models.target).__name__ == "TorchRuntime" and type(models.draft).__name__ == "TorchRuntime"
    assert models.target.info.exactness == "batch-invariant"


@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_greedy_speculative_output_equals_plain(models: LoadedModels, drafter: str) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    plain, _, _ = run(models, (), greedy)
    speculative, drafts, accepted = run(models, (drafter,), greedy)
    assert drafts > 0 and accepted > 0
    assert speculative == plain
    assert plain[0] == plain[1]  # the second round (prefix-cache hits) decodes the same


@pytest.mark.slow  # interpreted Triton: 80-100 s on 2 cores; tests/backends/torch checks the kernel
def test_greedy_speculation_equals_plain_with_the_gpus_row_attention(tiny_models: TinyModels) -> None:
    """Exact mode with the row attention (the Triton kernel a GPU runs, interpreted here; the short version
    of the fp32-rows cases): n-gram drafts, the prefix cache's second round."""
    settings = Settings(
        dtype="float32", attention="rows", target=str(tiny_models.target), draft=None, backend="torch",
        device="cpu", threads=1, context_size=512, max_running=4, calibration_cache=False,
    ).validate()  # fmt: skip
    loaded = load_models(settings, calibrate_costs=False)
    try:
        assert loaded.target.info.exactness == "batch-invariant"
        greedy = SamplingParams(temperature=0.0, max_tokens=40)
        (plain,), _, _ = run(loaded, (), greedy, rounds=1)  # interpreted: each round costs 20 s here
        speculative, drafts, accepted = run(loaded, ("ngram",), greedy)
        assert drafts > 0 and accepted > 0 and speculative == [plain, plain]
    finally:
        loaded.close()


def test_seeded_sampling_with_ngram_drafts_equals_plain_sampling(models: LoadedModels) -> None:
    # Near-greedy knobs: the n-gram drafter needs repeats to draft at all.
    sampled = SamplingParams(temperature=0.6, top_p=0.95, top_k=3, max_tokens=48, seed=11)
    plain, _, _ = run(models, (), sampled, rounds=1)
    speculative, drafts, _ = run(models, ("ngram",), sampled, rounds=1)
    assert drafts > 0
    assert speculative == plain


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


def test_knobs_grammar_and_logprobs_on_the_device_path(models: LoadedModels) -> None:
    """The torch verifier applies penalties and the grammar mask on the tensor, and logprobs are computed
    where the logits are: greedy speculation equals plain under them."""
    import json

    from specserve.request import GrammarSpec

    penalised = SamplingParams(
        max_tokens=32, ignore_eos=True, frequency_penalty=1.2, repetition_penalty=1.3, logprobs=2
    )
    constrained = SamplingParams(
        max_tokens=120, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)), logprobs=1
    )
    for params in (penalised, constrained):
        plain, _, _ = run(models, (), params, rounds=1)
        spec, drafts, _ = run(models, ("draft-model",), params, rounds=1)
        assert spec == plain and drafts > 0
    for output in plain[0]:  # the constrained run's three outputs
        assert set(json.loads(models.target.detokenize(output))) == {"name", "n"}


def test_a_step_makes_the_host_wait_once(models: LoadedModels) -> None:
    """Every step on the device path reads the device once (the verifier's emitted ids) and uploads nothing
    that would wait for the forward pass: greedy and sampled, with n-gram drafts, a grammar, penalties and
    logit_bias; requests asking logprobs add one read for the step, whatever their number
    (tests/support/host_waits.py reads the calls a CUDA device would wait on)."""
    import json

    from specserve.request import GrammarSpec
    from support.host_waits import HostWaits

    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    cases = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, max_tokens=24),
        SamplingParams(max_tokens=40, grammar=grammar, frequency_penalty=0.5, logit_bias=((7, 2.0),)),
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=3),
        SamplingParams(
            temperature=0.8,
            seed=5,
            logprobs=1,
            max_tokens=40,
            grammar=grammar,
            presence_penalty=0.4,
            repetition_penalty=1.2,
        ),
    ]
    for slot in range(models.target.info.max_sequences):  # other tests' engines left prefixes there
        models.target.free(slot)
    # No prefix cache: a spill of a slot's prefix to the host tier reads its KV (a wait of its own).
    engine = models.engine(drafters=("ngram",), policy=models.policy("fixed"), num_draft_tokens=4)
    prompt = models.target.tokenize(CODE * 3)
    for n, params in enumerate(cases):
        for i in range(3):
            engine.add_request(f"{n}-{i}", prompt[: 24 + 9 * i], params)
        steps = 0
        while engine.has_work():
            with HostWaits() as audit:
                engine.step()
            steps += 1
            assert not audit.copies(), (params, audit.copies())
            # logprobs: one more read for the whole step, of the emitted tokens' numbers
            assert len(audit.reads()) <= (1 if params.logprobs is None else 2), (params, audit.reads())
        assert steps > 3
    assert engine.stats.num_drafts > 0


def test_draft_model_chain_on_the_device(models: LoadedModels) -> None:
    """The torch draft model chooses its tokens where its logits are (drafters/draft_model_device.py): a
    step reads the device once per chain position plus the verifier's read, copies nothing blocking, and
    sampled drafts carry their distributions as tensors that the verifier reads there; the output then
    follows the target's exact distribution (chi-square and total variation over the first two tokens; in
    float32)."""
    from support.distribution import assert_follows, exact_pairs, sampled_pairs
    from support.host_waits import HostWaits

    drafter: Any = models.drafters["draft-model"]
    assert drafter.on_device
    for slot in range(models.target.info.max_sequences):  # other tests' engines left prefixes there
        models.target.free(slot)
    k = 4
    engine = models.engine(drafters=("draft-model",), policy=models.policy("fixed"), num_draft_tokens=k)
    prompt = models.target.tokenize(CODE * 3)
    for i in range(3):
        engine.add_request(f"w{i}", prompt[: 24 + 9 * i], SamplingParams(temperature=0.0, max_tokens=24))
    while engine.has_work():
        with HostWaits() as audit:
            engine.step()
        assert not audit.copies() and len(audit.reads()) <= 1 + k, audit.events
    assert engine.stats.num_accepted_tokens > 0
    if models.settings.dtype == "bfloat16":
        return  # the distribution once, in float32: bf16 emulated on a CPU took 24 s for it (AMD Zen 3)

    knobs: dict[str, Any] = {"temperature": 1.5, "top_k": 4, "top_p": 0.98}
    short = prompt[:30]  # where the draft model is confident enough to draft (p_min)
    expected = exact_pairs(models.target, 3, short, knobs)
    engine = models.engine(drafters=("draft-model",), policy=models.policy("fixed"), num_draft_tokens=2)
    n = 1500
    counts = sampled_pairs(engine, short, n, knobs)
    stats = engine.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both branches of rejection sampling
    # up to 16 pairs: sampling noise alone leaves a total variation of about 0.02-0.04 at n = 1500
    assert_follows(counts, expected, n, max_tv=0.06)
