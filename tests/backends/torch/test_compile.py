"""``--compile``: the row functions through torch.compile (Inductor's CPU backend here), against eager.

Fused kernels round differently from eager ones, so compiled logits are close, not equal; what must hold
exactly is exact mode's promise: the compiled tiles pass the load-time self-check, and greedy speculative
output equals plain output with compilation on.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specserve.backends.base import DecodeChunk  # noqa: E402
from specserve.backends.torch.runtime import TorchRuntime  # noqa: E402
from specserve.config import Settings  # noqa: E402
from specserve.engine.builder import load_models  # noqa: E402
from specserve.request import SamplingParams  # noqa: E402
from support.tiny_models import TinyModels  # noqa: E402

TEXT = "def check(values):\n    return [value * 2 for value in values if value]\n" * 3


def runtime(tiny_models: TinyModels, exact: bool, compile: bool) -> TorchRuntime:
    return TorchRuntime(
        tiny_models.target, context_per_sequence=256, max_sequences=2, n_threads=1, exact=exact,
        dtype="float32", compile=compile,
    )  # fmt: skip


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_compiled_rows_give_the_eager_logits(tiny_models: TinyModels, exact: bool) -> None:
    eager, compiled = runtime(tiny_models, exact, False), runtime(tiny_models, exact, True)
    try:
        assert compiled.row_functions.compiled and not eager.row_functions.compiled
        assert compiled.compile_seconds is not None and "compiled rows" in compiled.info.build
        # exact mode's compiled tiles passed the self-check (it turns exact mode off when they do not)
        assert compiled.info.exactness == ("batch-invariant" if exact else "off")
        ids = compiled.tokenize(TEXT)[:40]
        for n in (1, 9, 40):  # sizes the warm-up did not compile for
            a = eager.decode([DecodeChunk(0, ids[:n], 0, n)])[0]
            b = compiled.decode([DecodeChunk(0, ids[:n], 0, n)])[0]
            assert (a - b).abs().max().item() < 1e-4
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            eager.free(0)
            compiled.free(0)
    finally:
        eager.close()
        compiled.close()


def test_greedy_speculation_equals_plain_with_compiled_rows(tiny_models: TinyModels) -> None:
    """The setting end to end: exact mode (the default) compiled at load (target and draft model), noted,
    and greedy output with the draft model's proposals equal to plain output, sequence by sequence."""
    settings = Settings(
        target=str(tiny_models.target), draft=str(tiny_models.draft_close), load_draft="always",
        backend="torch", device="cpu", dtype="float32", threads=1, context_size=256, max_running=2,
        calibration_cache=False, compile=True,
    ).validate()  # fmt: skip
    loaded = load_models(settings, calibrate_costs=False, keep_draft=True)
    try:
        assert loaded.target.info.exactness == "batch-invariant"
        assert any(n.startswith("row functions compiled (torch.compile) in") for n in loaded.report.notes)
        prompt = loaded.target.tokenize(TEXT)
        outputs = []
        for drafters in ((), ("draft-model",)):
            engine = loaded.engine(drafters=drafters, policy=loaded.policy("fixed"), num_draft_tokens=4)
            for i in range(3):  # three sequences in one batch, at different positions
                engine.add_request(
                    str(i), prompt[: 24 + 9 * i], SamplingParams(temperature=0.0, max_tokens=32)
                )
            produced: dict[str, list[int]] = {}
            while engine.has_work():
                for out in engine.step():
                    produced.setdefault(out.request_id, []).extend(out.new_token_ids)
            outputs.append(produced)
            if drafters:
                assert engine.stats.num_drafts > 0 and engine.stats.num_accepted_tokens > 0
        assert outputs[0] == outputs[1] and all(len(t) == 32 for t in outputs[0].values())
    finally:
        loaded.close()


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_compiled_rope_and_cache_write_equal_eager(rows: int) -> None:
    """RoPE of q and k with k and v written into the cache, fused: the same bits as eager (elementwise, no
    reduction), every other cache position untouched (written in place, not a copy of the cache), at the
    head layout of Qwen2.5-1.5B (12 query heads, 2 KV heads of 128)."""
    from torch import Tensor

    from specserve.backends.torch.rows import rope_write

    compiled = torch.compile(rope_write, fullgraph=True)
    generator = torch.Generator().manual_seed(rows)

    def randn(*shape: int) -> Tensor:
        drawn: Tensor = torch.randn(*shape, generator=generator)
        return drawn

    q, k, v, cos, sin = (
        randn(rows, 12, 128),
        randn(rows, 2, 128),
        randn(rows, 2, 128),
        randn(rows, 1, 128),
        randn(rows, 1, 128),
    )
    slots = torch.randint(0, 4, (rows,), generator=generator)
    positions = torch.randperm(64, generator=generator)[:rows]
    caches = [(randn(4, 64, 2, 128), randn(4, 64, 2, 128)) for _ in range(2)]
    before = caches[0][0].clone(), caches[0][1].clone()
    caches[1] = (caches[0][0].clone(), caches[0][1].clone())
    eager_q = rope_write(q, k, v, cos, sin, *caches[0], slots, positions)
    compiled_q = compiled(q, k, v, cos, sin, *caches[1], slots, positions)
    assert torch.equal(eager_q, compiled_q)
    for eager, fused, old in zip(caches[0], caches[1], before, strict=True):
        assert torch.equal(eager, fused)
        untouched = torch.ones(4, 64, dtype=torch.bool)
        untouched[slots, positions] = False
        assert torch.equal(fused[untouched], old[untouched]) and not torch.equal(fused, old)
