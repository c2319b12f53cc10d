"""The tiny Hugging Face checkpoints load in transformers and behave: the torch runtime's tests lean on it.

transformers is the reference those tests compare against, so the checkpoint must be one it loads as is
(sharded or not, tied or not), with a tokenizer that agrees with ours, and weights whose greedy generations
vary (a degenerate model that repeats one token would let a broken runtime pass).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.backends.torch.hf_vocab import HFVocabulary
from support.tiny_hf import Family, write_tiny_hf_checkpoint
from support.tiny_models import CHAT_TEMPLATE, tiny_vocab

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

PROMPT = "Hello world, this is"


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_greedy_generations_vary(tmp_path: Path, family: Family, tied: bool) -> None:
    path = write_tiny_hf_checkpoint(tmp_path / "ck", family, seed=1, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.model_type == family and model.config.tie_word_embeddings == tied
    assert model.config.vocab_size == len(tiny_vocab().tokens)
    prompt = torch.tensor([HFVocabulary(path).tokenize(PROMPT)])
    out = model.generate(prompt, max_new_tokens=32, do_sample=False)[0, prompt.shape[1] :].tolist()
    assert len(set(out)) >= 16, out  # varied, not one token or a short loop
    assert not set(out) & set(tiny_vocab().special_ids)  # special tokens' logits sit low


def test_transformers_tokenizer_agrees(tmp_path: Path) -> None:
    path = write_tiny_hf_checkpoint(tmp_path / "ck", "qwen2")
    reference = transformers.AutoTokenizer.from_pretrained(path)
    ours = HFVocabulary(path)
    for text in ("Hello world, this is the test.", "ünïcødé 123 ✓ 你好", "def f(x):\n    return x\n"):
        assert reference(text).input_ids == ours.tokenize(text)
    messages = [{"role": "user", "content": "hi"}]
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ours.chat_template() == CHAT_TEMPLATE
    assert reference.eos_token == "<|im_end|>"
    assert reference.eos_token_id == tiny_vocab().token_id("<|im_end|>")


def test_cached_by_path_and_arguments(tmp_path: Path) -> None:
    path = write_tiny_hf_checkpoint(tmp_path / "ck", "llama", sharded=True)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").is_file()
    stamp = (path / "config.json").stat().st_mtime_ns
    assert write_tiny_hf_checkpoint(path, "llama", sharded=True) == path
    assert (path / "config.json").stat().st_mtime_ns == stamp  # not rewritten
    write_tiny_hf_checkpoint(path, "llama", sharded=False)  # other arguments: rewritten, no stale shards
    assert sorted(p.name for p in path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (path / "model.safetensors.index.json").exists()
