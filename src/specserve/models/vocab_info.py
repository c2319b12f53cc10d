"""The vocabulary facts of one model file or checkpoint that the draft/target compatibility check compares.

Its own module so that both readers, the GGUF header one (:mod:`specserve.models.compat`) and the Hugging
Face checkpoint one (:mod:`specserve.models.hf_dir`), build it without importing each other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from gguf import TokenType

__all__ = ["VocabInfo"]


@dataclass(frozen=True)
class VocabInfo:
    """The tokenizer metadata of one GGUF file (or of a checkpoint directory, as a GGUF of it would say)."""

    path: Path
    architecture: str | None  # general.architecture, e.g. "qwen2"
    tokenizer_model: str | None  # tokenizer.ggml.model, e.g. "gpt2" (BPE) or "llama" (SentencePiece)
    tokenizer_pre: str | None  # tokenizer.ggml.pre, the pre-tokenizer, e.g. "qwen2"
    tokens: tuple[str, ...]  # token text by id
    token_types: tuple[int, ...]  # gguf.TokenType by id; empty when the file has none
    bos_id: int | None
    eos_id: int | None
    add_bos: bool | None  # tokenizer.ggml.add_bos_token

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @cached_property
    def fingerprint(self) -> str:
        """sha256 of the token list; equal fingerprints mean identical token texts."""
        digest = hashlib.sha256()
        for token in self.tokens:
            data = token.encode("utf-8", errors="surrogateescape")
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
        return digest.hexdigest()

    def is_control(self, token_id: int) -> bool:
        return token_id < len(self.token_types) and self.token_types[token_id] == TokenType.CONTROL
