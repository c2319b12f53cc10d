"""The GPU check's CPU dry run (``--device cpu --tiny``): the command the device session will run, end to end.

Why it matters: a device session has minutes and may not come twice; a check that crashes there, or writes a
report missing a section, costs the whole session. Here every section must appear, every ratio be a
positive number, and the oracle's speculative output equal plain output for every acceptance rate. Fast
kernels are asserted identical too: on the CPU in float32 the tiny models' top-2 logit gaps (>= 8e-3) are
two orders of magnitude above the 9-row vs 1-row rounding difference (<= 6e-5).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.gpu_check import main
from benchmarks.gpu_check_checkpoint import write_checkpoint
from benchmarks.gpu_check_models import TINY_SHAPES, Shape, open_runtime, random_decoder
from benchmarks.gpu_check_oracle import OracleDrafter, generate, host_waits
from benchmarks.gpu_check_report import SECTIONS, plain_section, render, verify_section
from benchmarks.gpu_check_timing import context_tokens
from specserve.backends.base import DecodeChunk
from specserve.backends.torch.runtime import TorchRuntime
from specserve.request import PositionalUniforms, SamplingParams
from specserve.sequence import Sequence


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The dry run on one thread (steady on a shared machine); the process's setting restored after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def test_cpu_dry_run_writes_every_section(tmp_path: Path, one_thread: None) -> None:
    # float32 whatever --dtype auto picks on this CPU: the fast kernels' identity below needs its margins.
    args = [
        "--output-dir",
        str(tmp_path),
        "--device",
        "cpu",
        "--tiny",
        "--threads",
        "1",
        "--dtype",
        "float32",
    ]
    assert main(args) == 0
    data = json.loads((tmp_path / "gpu-check.json").read_text())
    markdown = (tmp_path / "gpu-check.md").read_text()
    assert data["status"] == "complete" and not data["errors"], data["errors"]
    assert data["device"] and data["dtype"] == "float32" and "--tiny" in data["command"]
    shapes = {"tiny-qwen2", "tiny-llama"}
    for section in SECTIONS:
        assert set(data[section]) == shapes, section
        assert f"## {section}" in markdown
    for shape in shapes:
        for mode in data["plain"][shape]["modes"].values():
            assert all(_positive(m["tokens_per_s"]) and _positive(m["step_ms"]) for m in mode.values())
        verify = data["verify"][shape]
        assert all(_positive(r) for rel in verify["relative_to_one_token"].values() for r in rel.values())
        assert set(verify["relative_to_one_token"]["eager"]) == {"2", "4", "8", "16"}
        assert all(_positive(r) for r in verify["draft_over_target_step"].values())
        exact = data["exact"][shape]
        assert exact["self_check"]["passed"]
        assert set(exact["exact_over_fast"]["eager"]) == {"1", "2", "4", "8", "16"}
        assert all(_positive(r) for r in exact["exact_over_fast"]["eager"].values())
        for kernels in ("exact", "fast"):
            entry = data["oracle"][shape][kernels]
            assert entry["plain_repeatable"] and _positive(entry["plain_tokens_per_s"])
            runs = entry["runs"]
            assert {(r["policy"], r["alpha"]) for r in runs} == {
                (p, a) for p in ("fixed", "cost") for a in (0.6, 0.8, 0.9)
            }
            assert all(r["identical"] and r["first_mismatch"] is None for r in runs), (shape, kernels)
            assert all(_positive(r["speedup"]) and r["mean_acceptance_length"] >= 1 for r in runs)
        compiled = data["numbers"][shape]["modes"]["compiled"]  # --compile's fused rows against eager
        assert compiled["greedy_identical"] and compiled["verify_rows"]["top1_agreement"] == 1.0
        serve = data["serve"][shape]  # the server as deployed: its engine process on the written checkpoint
        assert (
            serve["server"]["exactness"]["mode"] == "batch-invariant" and not serve["server"]["speculation"]
        )
        assert set(serve["streams"]) == {"1", "8"}
        for row in serve["streams"].values():
            assert all(_positive(row[k]) for k in ("engine_tokens_per_s", "server_tokens_per_s"))


def test_a_failed_compile_costs_its_mode_not_the_shape(
    tmp_path: Path, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchmarks.gpu_check as gpu_check

    def refusing(name: str, model: Any, **kwargs: Any) -> TorchRuntime:
        if kwargs.get("compile"):
            raise RuntimeError("no C++ compiler")
        return open_runtime(name, model, **kwargs)

    monkeypatch.setattr(gpu_check, "open_runtime", refusing)
    args = ["--output-dir", str(tmp_path), "--device", "cpu", "--tiny", "--threads", "1", "--dtype"]
    assert main([*args, "float32", "--shapes", "tiny-qwen2"]) == 0
    data = json.loads((tmp_path / "gpu-check.json").read_text())
    assert data["shapes"]["tiny-qwen2"]["compile_failed"] == "RuntimeError: no C++ compiler"
    assert not data["errors"] and set(data["plain"]["tiny-qwen2"]["modes"]) == {"eager", "exact"}
    assert "--compile failed" in (tmp_path / "gpu-check.md").read_text()


@pytest.mark.parametrize("shape", TINY_SHAPES, ids=lambda shape: shape.name)
def test_a_written_checkpoint_loads_back_as_the_same_model(shape: Shape, tmp_path: Path) -> None:
    """The serve section's checkpoint: the torch runtime reads it back to the logits of the model in memory
    (q/k/v and gate/up split and fused again, the tied or untied head, llama3 RoPE scaling), and every id
    has text."""
    model = random_decoder(shape.target, torch.device("cpu"), torch.float32, 64)
    in_memory = open_runtime(
        "mem", model, device=torch.device("cpu"), dtype="float32", exact=False, graphs=False,
        max_sequences=1, context=64, self_check=False, threads=1,
    )  # fmt: skip
    loaded = TorchRuntime(
        write_checkpoint(model, tmp_path), context_per_sequence=64, n_threads=1, exact=False, dtype="float32"
    )
    try:
        ids = context_tokens(shape.target.vocab_size, 24, seed=5)
        a = in_memory.decode([DecodeChunk(0, ids, 0, len(ids))])[0]
        b = loaded.decode([DecodeChunk(0, ids, 0, len(ids))])[0]
        assert torch.equal(a, b)
        assert loaded.info.vocab_size == shape.target.vocab_size
        assert loaded.detokenize([0, 7, shape.target.vocab_size - 1]) == f"t0t7t{shape.target.vocab_size - 1}"
    finally:
        in_memory.close()
        loaded.close()


def _seq(prompt: list[int]) -> Sequence:
    return Sequence("r", prompt, SamplingParams(), PositionalUniforms(0))


def test_oracle_drafter_replays_or_breaks_the_reference() -> None:
    reference = [5, 6, 7, 8, 9, 10]
    seq = _seq([1, 2])
    perfect, hopeless = OracleDrafter(reference, 1.0, 64), OracleDrafter(reference, 0.0, 64)
    for drafter in (perfect, hopeless):
        drafter.begin(seq)
    seq.output_ids = [5, 6]
    assert perfect.available(seq, 8).max_tokens == 4
    assert perfect.propose([seq], [3])[0].token_ids == [7, 8, 9]
    wrong = hopeless.propose([seq], [3])[0].token_ids
    assert all(w != t and 0 <= w < 64 for w, t in zip(wrong, [7, 8, 9], strict=True))
    seq.output_ids.append(99)  # left the reference: nothing more to offer
    assert perfect.available(seq, 8).max_tokens == 0 and perfect.diverged_at == 2


def test_host_waits_runs_each_case_to_its_end(one_thread: None) -> None:
    """The oracle's count of host waits per step (CUDA's sync debug mode on a GPU): on a CPU nothing can
    wait, and each case still runs its steps to the end, plain and with greedy and sampled drafts."""
    model = random_decoder(TINY_SHAPES[0].target, torch.device("cpu"), torch.float32, 128)
    runtime = open_runtime(
        "waits", model, device=torch.device("cpu"), dtype="float32", exact=True, graphs=False,
        max_sequences=2, context=128, self_check=False, threads=1,
    )  # fmt: skip
    try:
        prompt = context_tokens(TINY_SHAPES[0].target.vocab_size, 16, seed=2)
        reference = generate(runtime, prompt, 12).output  # what the oracle drafts from
        counted = host_waits(runtime, prompt, reference, k=4, tokens=12)
    finally:
        runtime.close()
    assert set(counted) == {"plain", "drafts", "drafts, sampled"}
    assert counted["plain"]["steps"] == 12 and all(c["waits_per_step"] == 0 for c in counted.values())
    assert counted["drafts"]["steps"] < 12  # drafts were accepted: fewer steps than tokens


def test_report_with_graphs_and_a_known_peak() -> None:
    """The CUDA-only branches (graphs mode, HBM share) that the CPU dry run cannot reach."""
    model_stub = torch.nn.Module()
    step = {"step_ms": 2.0, "tokens_per_s": 500.0}
    measured = {m: {1: dict(step), 8: dict(step)} for m in ("graphs", "eager", "exact")}
    measured["eager"][1] = {"step_ms": 4.0, "tokens_per_s": 250.0}

    class Config:
        tie_word_embeddings = True

    model_stub.config = Config()  # type: ignore[assignment]
    model_stub.w = torch.nn.Parameter(torch.zeros(1000, 1000, dtype=torch.bfloat16))
    plain = plain_section(measured, model_stub, 1024, 100.0, 4.8e12)  # type: ignore[arg-type]
    assert plain["graphs_over_eager_tokens_per_s"]["1"] == 2.0
    assert plain["modes"]["graphs"]["1"]["hbm_fraction"] == round((2e6 + 102400) / 2e-3 / 4.8e12, 4)
    calls = {m: {n: float(n) for n in (1, 2, 4, 8, 16)} for m in ("graphs", "eager", "exact")}
    calls.update({f"draft:{m}": {1: 0.5} for m in ("graphs", "eager", "exact")})
    verify = verify_section(calls)
    assert verify["graphs_over_eager"]["16"] == 1.0 and verify["draft_over_target_step"]["graphs"] == 0.5
    data = {
        "command": "scripts/gpu-check.sh --output-dir out",
        "device": "NVIDIA H200",
        "device_type": "cuda",
        "torch": "2.11",
        "cuda": "13.0",
        "dtype": "bfloat16",
        "date": "-",
        "status": "complete",
        "budget_seconds": 420.0,
        "tiny": False,
        "shapes": {},
        "skipped": [{"shape": "llama-3.1-8b", "why": "budget"}],
        "plain": {"s": plain},
        "verify": {"s": verify},
        "oracle": {
            "s": {"error": "RuntimeError: boom"},
            "t": {
                "fast": {
                    "exactness": "off",
                    "num_draft_tokens": 8,
                    "runs": [],
                    "plain_tokens_per_s": 90.0,
                    "max_tokens": 64,
                    "distinct_fraction": 0.5,
                    "plain_repeatable": True,
                    "host_waits": {
                        "plain": {"steps": 32, "waits_per_step": 1.0, "where": {"device.py:58": 32}}
                    },
                }
            },
        },
        "exact": {},
        "errors": [{"section": "oracle", "shape": "s", "error": "RuntimeError: boom"}],
    }
    text = render(data)
    assert "| graphs | 1 | 2.000 | 500.0 |" in text and "llama-3.1-8b** skipped" in text
    assert "failed: `RuntimeError: boom`" in text and "## errors" in text
    assert "fast, plain: 1.0 host waits per step over 32 steps" in text
