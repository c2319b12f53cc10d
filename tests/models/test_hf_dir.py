"""Hugging Face checkpoint directories in the model store: resolved as they are, their vocabulary read from
the JSON files alone, and comparable with a GGUF's, so a checkpoint can draft for a GGUF target and back.

The tiny checkpoint (written by transformers) shares the tiny GGUFs' vocabulary; hand-written JSON covers
what it does not (padded embeddings, eos lists, SentencePiece byte tokens), without tokenizers or torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest

from specserve.models.compat import check_draft_compatible, read_vocab
from specserve.models.errors import IncompatibleVocabError, ModelNotFoundError
from specserve.models.hf_dir import HFCheckpointError, is_hf_checkpoint, read_hf_vocab
from specserve.models.store import ModelStore
from support.tiny_hf import write_tiny_hf_checkpoint
from support.tiny_models import TinyModels, tiny_vocab

NORMAL, CONTROL, USER_DEFINED = (int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL), 4)
UNUSED, BYTE, UNKNOWN = int(gguf.TokenType.UNUSED), int(gguf.TokenType.BYTE), int(gguf.TokenType.UNKNOWN)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")  # and torch
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-hf") / "qwen3", "qwen3", seed=2)


def write_checkpoint(directory: Path, tokenizer: dict[str, Any], **files: dict[str, Any]) -> Path:
    """A checkpoint of JSON files only: ``tokenizer.json`` plus ``config.json`` etc. from ``files``."""
    directory.mkdir(parents=True, exist_ok=True)
    for stem, data in {"config": {"model_type": "llama"}, **files, "tokenizer": tokenizer}.items():
        (directory / f"{stem}.json").write_text(json.dumps(data))
    return directory


def byte_level_tokenizer(vocab: dict[str, int], added: list[tuple[int, str, bool]]) -> dict[str, Any]:
    return {
        "added_tokens": [{"id": i, "content": text, "special": special} for i, text, special in added],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "ByteLevel", "use_regex": False}]},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
    }


# -- the store ----------------------------------------------------------------------------------------


def test_resolve_a_checkpoint_directory(checkpoint: Path, tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "cache", catalog={})
    assert store.resolve(checkpoint) == checkpoint
    assert store.resolve(str(checkpoint)) == checkpoint
    assert is_hf_checkpoint(checkpoint) and not is_hf_checkpoint(checkpoint / "config.json")
    assert (checkpoint / "model.safetensors.index.json").is_file()  # sharded, as large checkpoints ship


def test_a_directory_without_config_json_is_refused_in_one_line(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "cache", catalog={})
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    for call in (store.resolve, read_vocab, read_hf_vocab):
        with pytest.raises(ModelNotFoundError, match=r"weights: a directory without config\.json") as info:
            call(tmp_path / "weights")
        assert "\n" not in str(info.value)
    with pytest.raises(ModelNotFoundError, match="nor an existing file or dir"):
        store.resolve(tmp_path / "missing")


# -- the vocabulary -----------------------------------------------------------------------------------


def test_vocab_equals_the_tiny_gguf(checkpoint: Path, tiny_models: TinyModels) -> None:
    """The same VocabInfo a GGUF of the checkpoint would carry: it drafts for a GGUF target, and back."""
    hf, target = read_vocab(checkpoint), read_vocab(tiny_models.target)
    assert hf.fingerprint == target.fingerprint and hf.tokens == tiny_vocab().tokens
    assert hf.token_types == target.token_types == tiny_vocab().token_types
    assert (hf.bos_id, hf.eos_id, hf.add_bos) == (target.bos_id, target.eos_id, target.add_bos)
    assert (hf.architecture, hf.tokenizer_model, hf.path) == ("qwen3", "gpt2", checkpoint)
    check_draft_compatible(target, hf)
    check_draft_compatible(hf, read_vocab(tiny_models.draft))


def test_models_read_checkpoints_without_torch_or_tokenizers(checkpoint: Path) -> None:
    """specserve.models is layer 1: the JSON files are read with the standard library."""
    code = (
        "import sys; from specserve.models import ModelStore, read_vocab; "
        f"read_vocab(ModelStore(catalog={{}}).resolve({str(checkpoint)!r})); "
        "heavy = ('torch', 'tokenizers', 'transformers', 'safetensors'); "
        "print(','.join(m for m in heavy if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == ""


def test_padded_embeddings_and_added_tokens(tmp_path: Path) -> None:
    """Ids below config.json's vocab_size that the tokenizer lacks are [PAD<id>] UNUSED (as the GGUF
    converter writes them); `<|...|>` added tokens are control even unmarked, others user-defined."""
    tokenizer = byte_level_tokenizer(
        {"a": 0, "b": 1, "Ġc": 2}, [(3, "<|end|>", True), (4, "<|tool|>", False), (6, "<tool_call>", False)]
    )
    path = write_checkpoint(tmp_path / "ck", tokenizer, config={"model_type": "qwen2", "vocab_size": 9})
    pads = ("[PAD7]", "[PAD8]")
    vocab = read_hf_vocab(path)
    assert vocab.tokens == ("a", "b", "Ġc", "<|end|>", "<|tool|>", "[PAD5]", "<tool_call>", *pads)
    assert vocab.token_types == (NORMAL,) * 3 + (CONTROL, CONTROL, UNUSED, USER_DEFINED, UNUSED, UNUSED)
    assert (vocab.tokenizer_model, vocab.architecture) == ("gpt2", "qwen2")
    assert (vocab.bos_id, vocab.eos_id) == (None, None)
    assert vocab.add_bos is None  # tokenizer_config does not say


def test_special_ids_follow_the_gguf_converter(tmp_path: Path) -> None:
    """tokenizer_config's token text wins (a string or an AddedToken dict); else config.json's id, the
    first of a list (Llama 3.1's eos_token_id), else generation_config.json's."""
    added = [(1, "<|begin|>", True), (2, "<|eot|>", True), (3, "<|e|>", True)]
    tokenizer = byte_level_tokenizer({"a": 0}, added)
    config = {"model_type": "llama", "bos_token_id": 3, "eos_token_id": [3, 2]}
    tokenizer_config = {"eos_token": {"content": "<|eot|>"}, "add_bos_token": True}
    vocab = read_hf_vocab(
        write_checkpoint(tmp_path / "a", tokenizer, config=config, tokenizer_config=tokenizer_config)
    )
    assert (vocab.bos_id, vocab.eos_id, vocab.add_bos) == (3, 2, True)
    vocab = read_hf_vocab(write_checkpoint(tmp_path / "b", tokenizer, config=config))
    assert (vocab.bos_id, vocab.eos_id) == (3, 3)
    generation = {"bos_token_id": 1, "eos_token_id": 2}
    path = write_checkpoint(
        tmp_path / "c", tokenizer, config={"model_type": "x"}, generation_config=generation
    )
    vocab = read_hf_vocab(path)
    assert (vocab.bos_id, vocab.eos_id) == (1, 2)


def test_sentencepiece_like_vocab(tmp_path: Path) -> None:
    """A Llama 2 style tokenizer.json (BPE with byte fallback): model "llama", byte and unknown types."""
    tokenizer = {
        "added_tokens": [{"id": 1, "content": "<s>", "special": True}],
        "decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]},
        "model": {
            "type": "BPE",
            "byte_fallback": True,
            "unk_token": "<unk>",
            "vocab": {"<unk>": 0, "<s>": 1, "<0x0A>": 2, "▁the": 3},
        },
    }
    vocab = read_hf_vocab(write_checkpoint(tmp_path / "ck", tokenizer))
    assert vocab.tokenizer_model == "llama"
    assert vocab.token_types == (UNKNOWN, CONTROL, BYTE, NORMAL)


def test_different_checkpoint_vocab_is_incompatible(checkpoint: Path, tmp_path: Path) -> None:
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    data["model"]["vocab"] = {f"x{text}": i for text, i in data["model"]["vocab"].items()}
    config = json.loads((checkpoint / "config.json").read_text())
    other = write_checkpoint(tmp_path / "other", data, config=config)
    with pytest.raises(IncompatibleVocabError, match="token 0 is"):
        check_draft_compatible(read_vocab(checkpoint), read_vocab(other))


def test_broken_checkpoint_files_are_one_line_errors(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ck", {"model": {"type": "BPE", "vocab": {"a": 0}}})
    (path / "tokenizer.json").unlink()
    with pytest.raises(HFCheckpointError, match=r"ck: checkpoint has no tokenizer\.json"):
        read_vocab(path)
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(HFCheckpointError, match=r"tokenizer\.json: cannot read JSON") as info:
        read_vocab(path)
    assert "\n" not in str(info.value)
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    with pytest.raises(HFCheckpointError, match="its model has no vocab"):
        read_vocab(path)
