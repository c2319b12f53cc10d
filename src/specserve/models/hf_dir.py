"""Hugging Face checkpoint directories: what a GPU user downloads, read with the standard library alone.

A checkpoint is a directory with ``config.json``, ``*.safetensors`` weights and the tokenizer files
(``tokenizer.json``, ``tokenizer_config.json``, optionally ``generation_config.json`` and
``chat_template.jinja``). The model store accepts one wherever it takes a GGUF file, and the draft/target
vocabulary check must work across the two formats, so :func:`read_hf_vocab` builds the same
:class:`~specserve.models.vocab_info.VocabInfo` that llama.cpp's ``convert_hf_to_gguf.py`` would write into a
GGUF converted from this directory: token texts in their stored (byte-level) form, added special tokens as
CONTROL, ids the tokenizer lacks below ``config.json``'s ``vocab_size`` padded as ``[PAD<id>]`` UNUSED.

The tokenizer-file facts that the torch runtime's vocabulary needs too (special tokens, end-of-generation
ids, the chat template) are parsed here once, in :class:`HFTokenizerFiles`, so both read them alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import TokenType

from specserve.models.errors import ModelNotFoundError, ModelStoreError
from specserve.models.vocab_info import VocabInfo

__all__ = [
    "EOG_TOKEN_TEXTS",
    "HFCheckpointError",
    "HFTokenizerFiles",
    "check_hf_checkpoint",
    "is_hf_checkpoint",
    "read_hf_vocab",
]

CONFIG_JSON = "config.json"
EOG_TOKEN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "<|eom_id|>")
"""End-of-turn tokens that end generation whenever the vocabulary has them (as llama.cpp's EOG set)."""


class HFCheckpointError(ModelStoreError):
    """A checkpoint directory lacks a file it needs, or one of its JSON files cannot be read."""


def is_hf_checkpoint(path: Path | str) -> bool:
    """Whether ``path`` is a directory with a ``config.json`` (a Hugging Face checkpoint)."""
    path = Path(path).expanduser()
    return path.is_dir() and (path / CONFIG_JSON).is_file()


def check_hf_checkpoint(path: Path) -> Path:
    """``path`` if it is a checkpoint directory; else ModelNotFoundError saying what is missing."""
    if not is_hf_checkpoint(path):
        raise ModelNotFoundError(
            f"{path}: a directory without {CONFIG_JSON}, not a Hugging Face checkpoint "
            "(expected config.json, *.safetensors and tokenizer.json)"
        )
    return path


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise HFCheckpointError(f"{path.parent}: checkpoint has no {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise HFCheckpointError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A tokenizer_config special token: a string, ``{"content": ...}`` (AddedToken), or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _int_ids(value: Any) -> list[int]:
    """``eos_token_id`` of config.json / generation_config.json: an int, a list of ints, or null."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _nodes(node: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object nested in ``node`` (a ``Sequence`` pre-tokenizer's parts, ...), itself first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _nodes(value)


@dataclass(frozen=True)
class HFTokenizerFiles:
    """The parsed JSON files of one checkpoint that describe its tokenizer and special tokens."""

    directory: Path
    config: dict[str, Any]  # config.json
    tokenizer: dict[str, Any]  # tokenizer.json
    tokenizer_config: dict[str, Any] = field(default_factory=dict)  # tokenizer_config.json, if any
    generation_config: dict[str, Any] = field(default_factory=dict)  # generation_config.json, if any

    @classmethod
    def load(cls, directory: Path | str) -> HFTokenizerFiles:
        directory = check_hf_checkpoint(Path(directory).expanduser())
        return cls(
            directory=directory,
            config=_read_json(directory / CONFIG_JSON, required=True),
            tokenizer=_read_json(directory / "tokenizer.json", required=True),
            tokenizer_config=_read_json(directory / "tokenizer_config.json", required=False),
            generation_config=_read_json(directory / "generation_config.json", required=False),
        )

    # -- the token table --------------------------------------------------------------------------------

    @property
    def model(self) -> dict[str, Any]:
        model = self.tokenizer.get("model")
        return model if isinstance(model, dict) else {}

    def model_vocab(self) -> dict[int, str]:
        """Id → token text of the tokenizer model (BPE, WordPiece: a dict; Unigram: [piece, score] pairs)."""
        vocab = self.model.get("vocab")
        if isinstance(vocab, dict):
            return {int(i): str(t) for t, i in vocab.items()}
        if isinstance(vocab, list):
            return {i: str(entry[0]) for i, entry in enumerate(vocab)}
        raise HFCheckpointError(f"{self.directory}/tokenizer.json: its model has no vocab")

    def added_tokens(self) -> list[dict[str, Any]]:
        """``added_tokens`` of tokenizer.json: ``{"id", "content", "special", ...}`` each."""
        added = self.tokenizer.get("added_tokens") or []
        return [t for t in added if isinstance(t, dict) and isinstance(t.get("id"), int)]

    @property
    def byte_level(self) -> bool:
        """GPT-2 style byte-level BPE: token texts are bytes mapped to printable code points ('Ġ' = space)."""
        parts = (self.tokenizer.get("pre_tokenizer"), self.tokenizer.get("decoder"))
        return any(node.get("type") == "ByteLevel" for part in parts for node in _nodes(part))

    @property
    def tokenizer_model(self) -> str | None:
        """As GGUF's ``tokenizer.ggml.model``: ``gpt2`` (byte-level BPE), ``llama`` (SentencePiece-like)..."""
        kind = self.model.get("type")
        if self.byte_level:
            return "gpt2"
        if kind == "Unigram" or (kind == "BPE" and self.model.get("byte_fallback")):
            return "llama"
        if kind == "WordPiece":
            return "bert"
        return None

    # -- special tokens ---------------------------------------------------------------------------------

    def token_id(self, text: str) -> int | None:
        """The id of a token text: an added token's content, or a model vocab entry."""
        for token in self.added_tokens():
            if token.get("content") == text:
                return int(token["id"])
        vocab = self.model.get("vocab")
        if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
            return int(vocab[text])
        return None

    def special_id(self, which: str) -> int | None:
        """``bos``/``eos`` id as the GGUF converter picks it: tokenizer_config's token text first, then
        ``<which>_token_id`` of config.json (an int; for a list, its first entry), then generation_config."""
        text = _token_content(self.tokenizer_config.get(f"{which}_token"))
        if text is not None and (found := self.token_id(text)) is not None:
            return found
        for source in (self.config, self.generation_config):
            ids = _int_ids(source.get(f"{which}_token_id"))
            if ids:
                return ids[0]
        return None

    def add_special_flag(self, which: str) -> bool | None:
        """tokenizer_config's ``add_<which>_token`` (``bos``/``eos``) when it says; None when it does not."""
        flag = self.tokenizer_config.get(f"add_{which}_token")
        return flag if isinstance(flag, bool) else None

    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation: every eos id of config.json, generation_config.json and tokenizer_config,
        plus the common end-of-turn tokens the vocabulary has."""
        ids = set(_int_ids(self.config.get("eos_token_id")))
        ids |= set(_int_ids(self.generation_config.get("eos_token_id")))
        eos = self.special_id("eos")
        if eos is not None:
            ids.add(eos)
        for text in EOG_TOKEN_TEXTS:
            if (found := self.token_id(text)) is not None:
                ids.add(found)
        return frozenset(ids)

    def chat_template(self) -> str | None:
        """``chat_template.jinja`` (transformers ≥ 4.43 writes it; it wins, as in transformers), else
        tokenizer_config's ``chat_template``: a string, or a list of named templates (``default`` used)."""
        jinja = self.directory / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        template = self.tokenizer_config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default", next(iter(named.values()), None))
        return template if isinstance(template, str) and template else None

    def vocab_size(self) -> int:
        """The model's vocabulary: config.json's ``vocab_size`` (the embedding rows) or the tokenizer's."""
        n_tokenizer = max([*self.model_vocab(), *(int(t["id"]) for t in self.added_tokens())], default=-1) + 1
        declared = self.config.get("vocab_size")
        return max(n_tokenizer, declared if isinstance(declared, int) else 0)


def _looks_special(text: str) -> bool:
    """As convert_hf_to_gguf's ``does_token_look_special``: ``<|...|>`` (and DeepSeek's ``<｜...｜>``) are
    control tokens even when tokenizer.json does not mark them special."""
    return (text.startswith("<|") and text.endswith("|>")) or (
        text.startswith("<｜") and text.endswith("｜>")
    )


def read_hf_vocab(path: Path | str) -> VocabInfo:
    """The vocabulary of a checkpoint directory, as a GGUF converted from it would carry it."""
    files = HFTokenizerFiles.load(path)
    n_vocab = files.vocab_size()
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [int(TokenType.UNUSED)] * n_vocab
    spm_bytes = files.tokenizer_model == "llama"
    unk = files.model.get("unk_token")
    for token_id, text in files.model_vocab().items():
        tokens[token_id] = text
        if spm_bytes and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types[token_id] = int(TokenType.BYTE)
        elif text == unk:
            types[token_id] = int(TokenType.UNKNOWN)
        else:
            types[token_id] = int(TokenType.NORMAL)
    for added in files.added_tokens():
        text = str(added.get("content", ""))
        tokens[int(added["id"])] = text
        control = bool(added.get("special")) or _looks_special(text)
        types[int(added["id"])] = int(TokenType.CONTROL if control else TokenType.USER_DEFINED)
    architecture = files.config.get("model_type")
    return VocabInfo(
        path=files.directory,
        architecture=str(architecture) if architecture is not None else None,
        tokenizer_model=files.tokenizer_model,
        tokenizer_pre=None,  # GGUF names the pre-tokenizer by hashing sample encodings; unknowable here
        tokens=tuple(tokens),
        token_types=tuple(types),
        bos_id=files.special_id("bos"),
        eos_id=files.special_id("eos"),
        add_bos=files.add_special_flag("bos"),
    )
