"""The tiny GGUF models load and behave in the real llama.cpp, fast and offline.

These checks back every other test that runs the real backend on them: valid files, a shared and sane
tokenizer, non-degenerate deterministic generation, a close draft that agrees often but not always, and the
batch-size independence of logits that the engine's exact mode relies on.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import numpy.typing as npt
import pytest
from gguf import TokenType
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from specserve.backends.llama_cpp_lib import llama_lib
from specserve.models.compat import check_draft_compatible, read_vocab
from support.tiny_models import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TinyModels,
    WeightType,
    tiny_vocab,
    write_tiny_model,
)

TEXTS = ["Hello world, this is the test.", "def f(self, x):\n    return x + 1\n", "ünïcødé 123 ✓"]


class Runner:
    """A single-sequence llama.cpp context through the low-level API, set up like the engine's exact mode."""

    def __init__(self, path: Path, *, n_ctx: int = 512, n_batch: int = 128) -> None:
        llama_lib()  # quiet logging and the backend initialised, as the runtime has them
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = False
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        assert self.model, f"llama.cpp failed to load {path}"
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_threads = cparams.n_threads_batch = 1
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        assert self.ctx
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.n_past = 0

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (ctypes.c_int32 * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), False, True)
        assert n >= 0
        return list(buf[:n])

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        self.n_past = 0

    def decode(self, tokens: list[int]) -> npt.NDArray[np.float32]:
        """Append `tokens` to the sequence in one llama_decode; return the logits of every one of them."""
        b = self.batch
        b.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, self.n_past + i, 1, True
            b.seq_id[i][0] = 0
        assert llama_cpp.llama_decode(self.ctx, b) == 0
        self.n_past += len(tokens)
        logits = llama_cpp.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(logits, shape=(len(tokens), self.n_vocab)).copy()

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], npt.NDArray[np.float32]]:
        """Greedy tokens and the logits that chose them, from a fresh sequence."""
        self.clear()
        rows = [self.decode(prompt)[-1]]
        out: list[int] = []
        for _ in range(n):
            out.append(int(np.argmax(rows[-1])))
            rows.append(self.decode([out[-1]])[0])
        return out, np.stack(rows[:-1])


@pytest.fixture
def runner() -> Iterator[Any]:
    opened: list[Runner] = []

    def open_runner(path: Path) -> Runner:
        opened.append(Runner(path))
        return opened[-1]

    yield open_runner
    for r in opened:
        r.close()


def _all_paths(models: TinyModels) -> list[Path]:
    return [models.target, models.draft, models.draft_close]


def test_vocabulary_layout() -> None:
    vocab = tiny_vocab()
    assert 300 <= len(vocab.tokens) <= 400
    assert len(set(vocab.tokens)) == len(vocab.tokens)
    assert vocab.tokens[-3:] == SPECIAL_TOKENS
    assert vocab.token_types[:-3] == (TokenType.NORMAL,) * (len(vocab.tokens) - 3)
    assert vocab.token_types[-3:] == (TokenType.CONTROL,) * 3
    assert "Ġthe" in vocab.tokens and "Ġreturn" in vocab.tokens


def test_models_share_one_vocabulary(tiny_models: TinyModels) -> None:
    target = read_vocab(tiny_models.target)
    assert (target.architecture, target.tokenizer_model, target.tokenizer_pre) == ("qwen2", "gpt2", "qwen2")
    assert target.add_bos is False
    assert target.eos_id == target.tokens.index("<|im_end|>")
    for draft in (tiny_models.draft, tiny_models.draft_close):
        check_draft_compatible(target, read_vocab(draft))
    assert tiny_models.target.read_bytes() != tiny_models.draft_close.read_bytes()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_detokenize_round_trip(tiny_models: TinyModels, text: str) -> None:
    for path in _all_paths(tiny_models):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=1, verbose=False)
        tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
        assert llm.detokenize(tokens).decode() == text
        assert llm.token_bos() not in tokens  # add_bos_token = False, as in Qwen2.5
        assert len(tokens) < len(text.encode()) or not text.isascii()  # the merges apply
        llm.close()


def test_special_tokens_end_generation(tiny_models: TinyModels, runner: Any) -> None:
    r = runner(tiny_models.target)
    ids = [r.tokenize(t) for t in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids)
    endoftext, im_start, im_end = (i[0] for i in ids)
    assert llama_cpp.llama_vocab_eos(r.vocab) == im_end
    assert llama_cpp.llama_vocab_is_eog(r.vocab, im_end)
    assert llama_cpp.llama_vocab_is_eog(r.vocab, endoftext)
    assert not llama_cpp.llama_vocab_is_eog(r.vocab, im_start)


def test_chat_template_read_back(tiny_models: TinyModels) -> None:
    llm = llama_cpp.Llama(model_path=str(tiny_models.target), n_ctx=128, n_threads=1, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    assert template == CHAT_TEMPLATE
    formatter = Jinja2ChatFormatter(template, eos_token="<|im_end|>", bos_token="<|endoftext|>")
    messages: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = formatter(messages=messages).prompt
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt == expected
    llm.close()


def test_greedy_generation_is_diverse_and_deterministic(tiny_models: TinyModels, runner: Any) -> None:
    for path in _all_paths(tiny_models):
        first, second = runner(path), runner(path)
        prompt = first.tokenize(TEXTS[0])
        tokens, logits = first.greedy(prompt, 32)
        again, logits_again = second.greedy(prompt, 32)
        assert len(set(tokens)) >= 8, f"{path.name}: degenerate greedy output {tokens}"
        assert not set(tokens) & set(range(first.n_vocab - 3, first.n_vocab))  # no special tokens
        assert tokens == again
        assert np.array_equal(logits, logits_again)
        assert np.all(logits[:, -3:] == -4.0)  # special-token logits are exactly eos_logit_bias
        assert 1.0 < float(logits.std(axis=1).mean()) < 10.0


def _agreement(target: Runner, draft: Runner, prompt: list[int], n: int) -> float:
    """Fraction of the target's greedy tokens that the draft also predicts greedily (teacher-forced)."""
    tokens, _ = target.greedy(prompt, n)
    draft.clear()
    predicted = draft.decode(prompt + tokens[:-1])[len(prompt) - 1 :].argmax(axis=1)
    return float(np.mean(predicted == np.array(tokens)))


def test_close_draft_agrees_often_unrelated_draft_rarely(tiny_models: TinyModels, runner: Any) -> None:
    target = runner(tiny_models.target)
    close, other = runner(tiny_models.draft_close), runner(tiny_models.draft)
    prompts = [target.tokenize(t) for t in TEXTS]
    close_rate = np.mean([_agreement(target, close, p, 48) for p in prompts])
    other_rate = np.mean([_agreement(target, other, p, 48) for p in prompts])
    assert 0.6 < close_rate < 0.97
    assert other_rate < 0.2


def test_positive_eos_bias_stops_at_once(tmp_path: Path, runner: Any) -> None:
    r = runner(write_tiny_model(tmp_path / "eos.gguf", seed=5, n_embd=32, n_layer=1, eos_logit_bias=20.0))
    tokens, _ = r.greedy(r.tokenize("Hello"), 1)
    assert llama_cpp.llama_vocab_is_eog(r.vocab, tokens[0])


@pytest.mark.parametrize("weight_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("shape", [{}, {"n_embd": 32, "n_layer": 1, "n_ff": 64}], ids=["target", "draft"])
def test_batch_logits_bit_identical_to_one_at_a_time(
    tmp_path: Path, runner: Any, weight_type: WeightType, shape: dict[str, int]
) -> None:
    """Exact mode (no weight repacking, no flash attention) makes a token's logits batch-size independent."""
    path = write_tiny_model(tmp_path / f"m-{weight_type}.gguf", seed=7, weight_type=weight_type, **shape)
    r = runner(path)
    tokens = (r.tokenize(TEXTS[1]) * 3)[:13]
    prefix, block = tokens[:5], tokens[5:]
    r.clear()
    r.decode(prefix)
    batched = r.decode(block)
    r.clear()
    r.decode(prefix)
    single = np.concatenate([r.decode([t]) for t in block])
    assert batched.shape == (8, r.n_vocab)
    assert np.array_equal(batched, single), f"max |diff| = {np.abs(batched - single).max()}"
