"""The torch decoder against Hugging Face ``transformers`` (a test-only oracle), from both weight formats.

Tiny random Qwen2, Qwen3 and Llama 3 checkpoints (Llama with its rope scaling) are scored by transformers
and by our runtime loaded from the checkpoint directory and from the same weights written as GGUF; llama.cpp
reading that GGUF checks the GGUF layout itself (the Llama q/k permutation in particular).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specserve.backends.base import DecodeChunk  # noqa: E402
from specserve.backends.llama_cpp import LlamaCppRuntime  # noqa: E402
from specserve.backends.torch.runtime import TorchRuntime  # noqa: E402
from support.hf_to_gguf import hf_to_gguf  # noqa: E402
from support.quantized import KQUANT_SHAPES, tensor_types, tiny_kquant_model  # noqa: E402
from support.tiny_hf import write_tiny_hf_checkpoint  # noqa: E402
from support.tiny_models import write_tiny_model  # noqa: E402

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES: dict[str, dict[str, Any]] = {
    "qwen2": {"family": "qwen2"},
    "qwen2-tied": {"family": "qwen2", "tie_word_embeddings": True, "sharded": False},
    "qwen3": {"family": "qwen3"},
    "llama3": {"family": "llama", "rope_scaling": LLAMA3_SCALING},
}
TOLERANCE = 1e-4
"""Max |logit difference| in float32: the same math in another order (fused q/k/v, SDPA vs eager)."""

TEXT = "def check(values):\n    return [value * 2 for value in values if value]\n" * 3


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp(request.param), **CASES[request.param])


def reference_logits(checkpoint: Path, ids: list[int]) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("exact", [False, True], ids=["fast", "exact"])
def test_logits_equal_transformers(checkpoint: Path, exact: bool) -> None:
    runtime = TorchRuntime(
        checkpoint, context_per_sequence=256, max_sequences=2, n_threads=1, exact=exact, dtype="float32"
    )
    try:
        ids = runtime.tokenize(TEXT)[:90]
        expected = reference_logits(checkpoint, ids)
        # A prompt chunk, then the rest one verify-sized chunk at a time, beside another sequence.
        got = [runtime.decode([DecodeChunk(0, ids[:40], 0, 40)])[0]]
        for lo in range(40, len(ids), 5):
            step = runtime.decode([DecodeChunk(1, ids[:3], 0, 1), DecodeChunk(0, ids[lo : lo + 5], lo, 5)])
            runtime.free(1)
            got.append(step[1])
        diff = (torch.cat(got) - expected).abs().max().item()
        assert diff < TOLERANCE, f"max |logit difference| {diff}"
    finally:
        runtime.close()


def test_gguf_of_the_same_weights_gives_the_same_logits(checkpoint: Path, tmp_path: Path) -> None:
    gguf_path = hf_to_gguf(checkpoint, tmp_path / "model.gguf")
    from_dir = TorchRuntime(checkpoint, context_per_sequence=128, n_threads=1, exact=False, dtype="float32")
    from_gguf = TorchRuntime(gguf_path, context_per_sequence=128, n_threads=1, exact=False, dtype="float32")
    try:
        ids = from_dir.tokenize(TEXT)[:60]
        assert from_gguf.tokenize(TEXT)[:60] == ids  # llama.cpp's tokenizer of the GGUF, the same vocabulary
        a = from_dir.decode([DecodeChunk(0, ids, 0, len(ids))])[0]
        b = from_gguf.decode([DecodeChunk(0, ids, 0, len(ids))])[0]
        assert (a - b).abs().max().item() < TOLERANCE
    finally:
        from_dir.close()
        from_gguf.close()


def test_llama_cpp_reads_that_gguf_as_transformers_does(checkpoint: Path, tmp_path: Path) -> None:
    """The GGUF writer mirrors llama.cpp's converter; llama.cpp scoring it like transformers proves the
    layout (f16 KV cache: close, not equal), so the loader's un-permutation is checked against llama.cpp."""
    if "tie" in checkpoint.name or "qwen3" in checkpoint.name:
        pytest.skip("one untied Qwen2 and the Llama case cover the layouts")
    gguf_path = hf_to_gguf(checkpoint, tmp_path / "model.gguf")
    llama = LlamaCppRuntime(gguf_path, context_per_sequence=128, n_threads=1, exact=False)
    try:
        ids = llama.tokenize(TEXT)[:60]
        got = llama.decode([DecodeChunk(0, ids, 0, len(ids))])[0].copy()
    finally:
        llama.close()
    expected = reference_logits(checkpoint, ids).numpy()
    assert np.abs(got - expected).max() < 0.05
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.95


def test_hidden_states_of_chosen_layers(checkpoint: Path) -> None:
    runtime = TorchRuntime(
        checkpoint, context_per_sequence=128, max_sequences=2, n_threads=1, exact=False, dtype="float32"
    )
    try:
        ids = runtime.tokenize(TEXT)[:20]
        runtime.capture_layers = (0, 1)
        runtime.decode([DecodeChunk(0, ids[:12], 0, 1), DecodeChunk(1, ids[:8], 0, 0)])
        assert runtime.hidden is not None
        assert runtime.hidden.offsets == (0, 12, 20)
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        with torch.no_grad():
            states = model(torch.tensor([ids[:12]]), output_hidden_states=True).hidden_states
        for i, layer in enumerate(runtime.capture_layers):
            ours = runtime.hidden[0][:, i]
            if layer == runtime.config.num_layers - 1:  # transformers' last state is after the final norm
                ours = runtime.model.norm(ours)
            diff = (ours - states[layer + 1][0]).abs().max().item()
            assert diff < TOLERANCE
    finally:
        runtime.close()


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q5_K_M", "Q6_K", "q8_0"])
def test_quantized_gguf_dequantizes_as_llama_cpp_computes(ftype: str, tmp_path: Path) -> None:
    """K-quants (llama.cpp's own quantizer) and Q8_0: our dequantized weights against llama.cpp running
    the quantized file (which also quantizes activations: close, not equal)."""
    if ftype == "q8_0":
        path = write_tiny_model(tmp_path / "q8.gguf", seed=5, weight_type="q8_0", **KQUANT_SHAPES)
    else:
        path = tiny_kquant_model(tmp_path, ftype)
        assert {"Q4_K", "Q5_K", "Q6_K"} & set(tensor_types(path).values())
    ours = TorchRuntime(path, context_per_sequence=128, n_threads=1, exact=False, dtype="float32")
    llama = LlamaCppRuntime(path, context_per_sequence=128, n_threads=1, exact=False)
    try:
        ids = ours.tokenize(TEXT)[:48]
        a = ours.decode([DecodeChunk(0, ids, 0, len(ids))])[0].numpy()
        b = llama.decode([DecodeChunk(0, ids, 0, len(ids))])[0].copy()
    finally:
        ours.close()
        llama.close()
    spread = float(b.max() - b.min())
    assert np.abs(a - b).max() < 0.05 * spread
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9
