"""The llama.cpp runtime on the tiny models: load errors, vocabulary, and the exactness the engine relies on.

Exact mode promises bit-identical logits for a token whatever else shares its batch, whether its cache was
rolled back and refilled, and however a long prompt is cut into llama batches; these tests compare with
``np.array_equal``, never with a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from specserve.backends.base import DecodeChunk, DecodeError, ModelLoadError
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.models import read_header
from support.tiny_models import CHAT_TEMPLATE, TinyModels, tiny_vocab

Logits = npt.NDArray[np.float32]
OpenRuntime = Callable[..., LlamaCppRuntime]

TEXTS = ["Hello world, this is the test.", "def f(self, x):\n    return x + 1\n", "ünïcødé 123 ✓ 你好"]


@pytest.fixture
def open_runtime(tiny_models: TinyModels) -> Iterator[OpenRuntime]:
    """Open runtimes (one thread, small context by default) that are closed after the test."""
    opened: list[LlamaCppRuntime] = []

    def factory(path: Path | None = None, **kwargs: object) -> LlamaCppRuntime:
        options: dict[str, object] = {"n_threads": 1, "context_per_sequence": 256} | kwargs
        runtime = LlamaCppRuntime(path or tiny_models.target, **options)  # type: ignore[arg-type]
        opened.append(runtime)
        return runtime

    yield factory
    for runtime in opened:
        runtime.close()


def tokens_of(n: int, seed: int) -> list[int]:
    """``n`` ordinary (non-special) token ids, seeded."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, len(tiny_vocab().tokens) - 3, n)]


def decode_copy(runtime: LlamaCppRuntime, *chunks: DecodeChunk) -> list[Logits]:
    """Decode and copy the logits out (the returned arrays are views, valid until the next decode)."""
    return [rows.copy() for rows in runtime.decode(list(chunks))]


# -- loading ------------------------------------------------------------------------------------------


def _missing(tmp_path: Path, target: Path) -> Path:
    return tmp_path / "missing.gguf"


def _truncated(tmp_path: Path, target: Path) -> Path:
    header = read_header(target, keys=())
    cut = header.data_offset + (header.required_size - header.data_offset) // 2  # mid tensor data
    path = tmp_path / "truncated.gguf"
    path.write_bytes(target.read_bytes()[:cut])
    return path


def _random_bytes(tmp_path: Path, target: Path) -> Path:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    return path


def _empty(tmp_path: Path, target: Path) -> Path:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    return path


@pytest.mark.parametrize("make_bad_file", [_missing, _truncated, _random_bytes, _empty])
def test_bad_model_file_raises_model_load_error_naming_the_path(
    make_bad_file: Callable[[Path, Path], Path], tmp_path: Path, tiny_models: TinyModels
) -> None:
    path = make_bad_file(tmp_path, tiny_models.target)
    with pytest.raises(ModelLoadError) as excinfo:
        LlamaCppRuntime(path, n_threads=1, context_per_sequence=64)
    assert str(path) in str(excinfo.value)
    assert "\n" not in str(excinfo.value)


def test_runtime_info(open_runtime: OpenRuntime, tiny_models: TinyModels) -> None:
    runtime = open_runtime(context_per_sequence=200, max_sequences=3)
    info = runtime.info
    assert info.vocab_size == len(tiny_vocab().tokens)
    assert info.context_per_sequence == 200
    assert info.max_sequences == 3
    assert info.n_threads == 1
    assert info.exact is True
    assert info.path == str(tiny_models.target)
    assert "qwen2" in info.description


def test_close_is_idempotent_and_final(open_runtime: OpenRuntime) -> None:
    runtime = open_runtime()
    (rows,) = runtime.decode([DecodeChunk(0, tokens_of(4, 1), 0, 1)])
    assert rows.shape == (1, runtime.info.vocab_size)
    runtime.close()
    runtime.close()  # a second close frees nothing twice (it would abort the process)
    with pytest.raises(DecodeError, match="closed"):
        runtime.decode([DecodeChunk(0, tokens_of(4, 1), 4, 1)])


# -- vocabulary -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_detokenize_round_trip(open_runtime: OpenRuntime, text: str) -> None:
    runtime = open_runtime()
    ids = runtime.tokenize(text)
    assert ids, "every non-empty text has tokens"
    assert all(0 <= t < runtime.info.vocab_size for t in ids)
    assert runtime.detokenize(ids) == text
    assert b"".join(runtime.token_bytes(t) for t in ids) == text.encode("utf-8")


def test_tokenize_adds_no_bos_and_merges(open_runtime: OpenRuntime) -> None:
    runtime = open_runtime()
    vocab = tiny_vocab()
    # Qwen-style: no BOS is added; "def" is one merged token.
    assert runtime.tokenize("def") == [vocab.token_id("def")]


def test_special_tokens(open_runtime: OpenRuntime) -> None:
    runtime = open_runtime()
    vocab = tiny_vocab()
    im_end = vocab.token_id("<|im_end|>")
    assert runtime.tokenize("<|im_end|>", parse_special=True) == [im_end]
    assert runtime.tokenize("<|im_end|>", parse_special=False) != [im_end]
    assert runtime.is_eog(im_end)
    assert not runtime.is_eog(runtime.tokenize("a")[0])
    assert runtime.special_token_text("eos") == "<|im_end|>"
    assert runtime.special_token_text("bos") == "<|endoftext|>"


def test_chat_template(open_runtime: OpenRuntime) -> None:
    template = open_runtime().chat_template()
    assert template
    assert template == CHAT_TEMPLATE


# -- evaluation -------------------------------------------------------------------------------------


def test_multi_sequence_batch_equals_each_sequence_alone(open_runtime: OpenRuntime) -> None:
    prompts = [tokens_of(n, seed) for n, seed in ((7, 1), (12, 2), (3, 3))]
    num_logits = [1, 3, 2]
    batched = open_runtime(max_sequences=3)
    alone = open_runtime(max_sequences=3)

    chunks = [DecodeChunk(s, p, 0, k) for s, (p, k) in enumerate(zip(prompts, num_logits, strict=True))]
    together = decode_copy(batched, *chunks)
    for chunk, rows in zip(chunks, together, strict=True):
        assert rows.shape == (chunk.num_logits, batched.info.vocab_size)
        assert rows.dtype == np.float32
        assert np.all(np.isfinite(rows))
        (single,) = decode_copy(alone, chunk)
        assert np.array_equal(rows, single)

    # A decode step (different lengths per sequence) after the mixed prefill.
    steps = [DecodeChunk(s, tokens_of(1 + s, 10 + s), len(p), 1 + s) for s, p in enumerate(prompts)]
    together = decode_copy(batched, *steps)
    for chunk, rows in zip(steps, together, strict=True):
        (single,) = decode_copy(alone, chunk)
        assert rows.shape == (chunk.num_logits, batched.info.vocab_size)
        assert np.array_equal(rows, single)


def test_truncate_then_redecode_reproduces_logits(open_runtime: OpenRuntime) -> None:
    runtime = open_runtime()
    prompt, draft, other = tokens_of(20, 4), tokens_of(5, 5), tokens_of(5, 6)
    decode_copy(runtime, DecodeChunk(0, prompt, 0, 1))
    (first,) = decode_copy(runtime, DecodeChunk(0, draft, len(prompt), len(draft)))

    runtime.truncate(0, len(prompt))
    (again,) = decode_copy(runtime, DecodeChunk(0, draft, len(prompt), len(draft)))
    assert np.array_equal(first, again)

    # Keep two accepted tokens, then evaluate the rest again after them.
    runtime.truncate(0, len(prompt) + 2)
    (rest,) = decode_copy(runtime, DecodeChunk(0, draft[2:], len(prompt) + 2, len(draft) - 2))
    assert np.array_equal(first[2:], rest)

    # A rejected draft of other tokens is rolled back; the original tokens in its place give the same.
    runtime.truncate(0, len(prompt))
    decode_copy(runtime, DecodeChunk(0, other, len(prompt), len(other)))
    runtime.truncate(0, len(prompt))
    (refilled,) = decode_copy(runtime, DecodeChunk(0, draft, len(prompt), len(draft)))
    assert np.array_equal(first, refilled)


def test_free_then_reuse_slot_matches_a_fresh_runtime(open_runtime: OpenRuntime) -> None:
    used = open_runtime(max_sequences=2)
    decode_copy(used, DecodeChunk(1, tokens_of(30, 7), 0, 1))
    decode_copy(used, DecodeChunk(0, tokens_of(9, 8), 0, 1))  # another sequence stays in the cache
    used.free(1)
    second = tokens_of(11, 9)
    (reused,) = decode_copy(used, DecodeChunk(1, second, 0, 3))

    fresh = open_runtime(max_sequences=2)
    (expected,) = decode_copy(fresh, DecodeChunk(1, second, 0, 3))
    assert np.array_equal(reused, expected)


def test_batch_larger_than_capacity(open_runtime: OpenRuntime) -> None:
    prompt = tokens_of(100, 10)
    small = open_runtime(batch_capacity=32, max_sequences=2)
    large = open_runtime(batch_capacity=512, max_sequences=2)

    (pieces,) = decode_copy(small, DecodeChunk(0, prompt, 0, 3))
    (whole,) = decode_copy(large, DecodeChunk(0, prompt, 0, 3))
    assert pieces.shape == (3, small.info.vocab_size)
    assert np.array_equal(pieces, whole)

    # Two sequences whose chunks together overflow the batch, logits wanted from both.
    other = tokens_of(40, 11)
    split = decode_copy(small, DecodeChunk(1, other, 0, 2), DecodeChunk(0, [5, 6], 100, 2))
    joint = decode_copy(large, DecodeChunk(1, other, 0, 2), DecodeChunk(0, [5, 6], 100, 2))
    for a, b in zip(split, joint, strict=True):
        assert a.shape == (2, small.info.vocab_size)
        assert np.array_equal(a, b)


def test_chunks_without_logits(open_runtime: OpenRuntime) -> None:
    prompt = tokens_of(24, 12)
    chunked = open_runtime(max_sequences=2)
    (none,) = chunked.decode([DecodeChunk(0, prompt[:16], 0, 0)])
    assert none.shape == (0, chunked.info.vocab_size)

    # Mixed: a logit-free prefill chunk next to a chunk that wants logits.
    rows = decode_copy(chunked, DecodeChunk(0, prompt[16:], 16, 0), DecodeChunk(1, prompt[:5], 0, 2))
    assert [r.shape[0] for r in rows] == [0, 2]
    (last,) = decode_copy(chunked, DecodeChunk(0, [7], 24, 1))

    # Chunked prefill without logits leaves the same cache as one prefill.
    whole = open_runtime(max_sequences=2)
    decode_copy(whole, DecodeChunk(0, prompt, 0, 1))
    (expected,) = decode_copy(whole, DecodeChunk(0, [7], 24, 1))
    assert np.array_equal(last, expected)
    (expected_other,) = decode_copy(whole, DecodeChunk(1, prompt[:5], 0, 2))
    assert np.array_equal(rows[1], expected_other)
