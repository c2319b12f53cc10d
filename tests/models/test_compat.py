"""Vocabulary compatibility and GGUF file checks on tiny GGUF files written with gguf.GGUFWriter."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from specserve.models.catalog import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET
from specserve.models.compat import check_draft_compatible, check_gguf_file, read_vocab
from specserve.models.errors import GGUFFileError, IncompatibleVocabError
from specserve.models.gguf_header import read_header
from specserve.models.store import ModelStore

NORMAL, CONTROL = int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL)
BASE_TOKENS = ["<s>", "</s>", *(f"tok{i}" for i in range(40))]
BASE_TYPES = [CONTROL, CONTROL, *([NORMAL] * 40)]


def write_gguf(
    path: Path,
    tokens: list[str] = BASE_TOKENS,
    token_types: list[int] = BASE_TYPES,
    model: str = "gpt2",
    bos: int = 0,
    eos: int = 1,
) -> Path:
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(["t o", "to k"])
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_add_bos_token(False)
    writer.add_tensor(
        "token_embd.weight", np.arange(len(tokens) * 4, dtype=np.float32).reshape(len(tokens), 4)
    )
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_read_vocab(tmp_path: Path) -> None:
    vocab = read_vocab(write_gguf(tmp_path / "m.gguf"))
    assert (vocab.architecture, vocab.tokenizer_model, vocab.tokenizer_pre) == ("qwen2", "gpt2", "qwen2")
    assert vocab.tokens == tuple(BASE_TOKENS) and vocab.token_types == tuple(BASE_TYPES)
    assert (vocab.bos_id, vocab.eos_id, vocab.add_bos, vocab.n_vocab) == (0, 1, False, 42)
    assert vocab.is_control(1) and not vocab.is_control(2)


def test_read_header_agrees_with_gguf_reader(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    header, oracle = read_header(path), gguf.GGUFReader(path)
    assert header.data_offset == oracle.data_offset
    ours = [(t.name, header.data_offset + t.offset, t.n_bytes) for t in header.tensors]
    assert ours == [(t.name, t.data_offset, t.n_bytes) for t in oracle.tensors]
    assert header.metadata["tokenizer.ggml.merges"] == ("t o", "to k")
    assert header.required_size <= os.path.getsize(path)


def test_identical_vocabularies_are_compatible(tmp_path: Path) -> None:
    target = read_vocab(write_gguf(tmp_path / "target.gguf"))
    draft = read_vocab(write_gguf(tmp_path / "draft.gguf"))
    assert target.fingerprint == draft.fingerprint
    check_draft_compatible(target, draft)


def test_fingerprint_changes_with_any_token(tmp_path: Path) -> None:
    target = read_vocab(write_gguf(tmp_path / "target.gguf"))
    tokens = [*BASE_TOKENS]
    tokens[-1] = "other"
    assert read_vocab(write_gguf(tmp_path / "draft.gguf", tokens)).fingerprint != target.fingerprint


def test_small_size_difference_is_compatible(tmp_path: Path) -> None:
    padded = [*BASE_TOKENS, *(f"<pad{i}>" for i in range(100))]
    target = read_vocab(write_gguf(tmp_path / "target.gguf", padded, [*BASE_TYPES, *([NORMAL] * 100)]))
    draft = read_vocab(write_gguf(tmp_path / "draft.gguf"))
    assert target.fingerprint != draft.fingerprint
    check_draft_compatible(target, draft)


def test_too_large_size_difference(tmp_path: Path) -> None:
    padded = [*BASE_TOKENS, *(f"<pad{i}>" for i in range(129))]
    target = read_vocab(write_gguf(tmp_path / "target.gguf", padded, [*BASE_TYPES, *([NORMAL] * 129)]))
    draft = read_vocab(write_gguf(tmp_path / "draft.gguf"))
    with pytest.raises(IncompatibleVocabError, match=r"vocab size 171 vs 42 differs by 129 \(at most 128"):
        check_draft_compatible(target, draft)


def test_different_text_at_a_shared_id(tmp_path: Path) -> None:
    tokens = [*BASE_TOKENS]
    tokens[7] = "changed"
    target = read_vocab(write_gguf(tmp_path / "target.gguf"))
    draft = read_vocab(write_gguf(tmp_path / "draft.gguf", tokens))
    with pytest.raises(
        IncompatibleVocabError, match="token 7 is 'tok5' in the target but 'changed' in the draft"
    ):
        check_draft_compatible(target, draft)


def test_control_token_texts_may_differ(tmp_path: Path) -> None:
    tokens = [*BASE_TOKENS]
    tokens[1] = "<|endoftext|>"
    target = read_vocab(write_gguf(tmp_path / "target.gguf"))
    check_draft_compatible(target, read_vocab(write_gguf(tmp_path / "draft.gguf", tokens)))


def test_different_tokenizer_model_and_special_ids(tmp_path: Path) -> None:
    target = read_vocab(write_gguf(tmp_path / "target.gguf"))
    draft = read_vocab(write_gguf(tmp_path / "draft.gguf", model="llama", eos=2))
    with pytest.raises(IncompatibleVocabError) as info:
        check_draft_compatible(target, draft)
    message = str(info.value)
    assert "draft draft.gguf cannot speculate for target target.gguf" in message
    assert "tokenizer model 'gpt2' vs 'llama'" in message
    assert "eos token id 1 vs 2" in message and "bos" not in message


def test_check_gguf_file_accepts_a_complete_file(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    header = check_gguf_file(path)
    assert [t.name for t in header.tensors] == ["token_embd.weight", "output_norm.weight"]


def test_check_gguf_file_missing(tmp_path: Path) -> None:
    with pytest.raises(GGUFFileError, match="no such file"):
        check_gguf_file(tmp_path / "missing.gguf")


def test_check_gguf_file_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04 not a model")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFFileError, match=r"model\.bin: not a GGUF file"):
        check_gguf_file(tmp_path / "model.bin")
    with pytest.raises(GGUFFileError, match="not a GGUF file"):
        check_gguf_file(tmp_path / "empty.gguf")


def test_check_gguf_file_truncated_tensor_data(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    needed = check_gguf_file(path).required_size
    os.truncate(path, needed - 1)
    with pytest.raises(
        GGUFFileError, match=f"truncated GGUF file: {needed - 1} bytes, .* needs {needed} bytes"
    ):
        check_gguf_file(path)


def test_check_gguf_file_truncated_header(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    os.truncate(path, 100)
    with pytest.raises(GGUFFileError, match="unreadable GGUF header"):
        check_gguf_file(path)
    with pytest.raises(GGUFFileError, match="unreadable GGUF header"):
        read_vocab(path)


@pytest.mark.model
def test_default_pair_is_compatible() -> None:
    store = ModelStore()
    target_path, draft_path = store.locate(CATALOG[DEFAULT_TARGET]), store.locate(CATALOG[DEFAULT_DRAFT])
    if target_path is None or draft_path is None:
        pytest.skip(f"default models not assembled in {store.cache_dir} (run `specserve models pull`)")
    check_gguf_file(target_path)
    check_gguf_file(draft_path)
    target, draft = read_vocab(target_path), read_vocab(draft_path)
    assert (target.tokenizer_model, target.n_vocab, target.eos_id) == ("gpt2", 151936, 151645)
    check_draft_compatible(target, draft)
