"""A Hugging Face checkpoint's vocabulary through the ``tokenizers`` library: the torch runtime's tokenizer.

It answers what :class:`~specserve.backends.base.Vocabulary` and the runtime need exactly as
:class:`~specserve.backends.llama_cpp_vocab.LlamaCppVocabulary` does for a GGUF, so chat prompts, stop
detection and streaming behave the same whichever format a model comes in:

* ``tokenize(parse_special=False)`` never turns special-token text in user input into control tokens (the
  role-injection defence of :func:`specserve.chat.chat_prompt_ids`): the tokenizer's
  ``encode_special_tokens`` switch makes it tokenize ``<|im_start|>`` as plain text.
* ``add_special`` adds what the model wants at the start (BOS): tokenizer_config's ``add_bos_token`` /
  ``add_eos_token`` when it states them (transformers rebuilds the post-processor from them too), else the
  post-processor of tokenizer.json.
* ``token_bytes`` gives the raw bytes of one token, possibly part of a UTF-8 character, so the runtime's
  ``detokenize`` and the server's incremental decoder can join them.

The checkpoint's JSON files are parsed by :class:`~specserve.models.hf_dir.HFTokenizerFiles`, shared with
the model store's draft/target vocabulary check.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.backends.base import DecodeError, ModelLoadError
from specserve.models.errors import ModelStoreError
from specserve.models.hf_dir import HFTokenizerFiles

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["HFVocabulary", "byte_decoder"]


def byte_decoder() -> dict[str, int]:
    """GPT-2's printable code point → byte map (the inverse of its ``bytes_to_unicode``: 'Ġ' → 0x20)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    code_points = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            code_points.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, code_points, strict=True)}


class HFVocabulary:
    """The tokenizer of a Hugging Face checkpoint directory (``tokenizer.json`` and its companions)."""

    vocab_size: int
    """The model's vocabulary: max(config.json ``vocab_size``, tokenizer size); logits rows are this wide."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        try:
            files = HFTokenizerFiles.load(path)
        except ModelStoreError as exc:
            raise ModelLoadError(str(exc)) from None
        try:
            tokenizer = Tokenizer.from_file(str(files.directory / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ModelLoadError(f"{files.directory}/tokenizer.json: cannot load ({exc})") from None
        tokenizer.no_truncation()  # some checkpoints ship a 512-token truncation; prompts must stay whole
        tokenizer.no_padding()
        self._tokenizer: Tokenizer = tokenizer
        self._lock = threading.Lock()  # encode_special_tokens is tokenizer state: set and encode together
        self._byte_level = files.byte_level
        self._byte_decoder = byte_decoder()
        self._sentencepiece = files.tokenizer_model == "llama"  # '▁' for space, <0xAB> byte-fallback tokens
        added = tokenizer.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}  # id → text
        self._control = frozenset(i for i, t in added.items() if t.special)
        self._bos_id = files.special_id("bos")
        self._eos_id = files.special_id("eos")
        self._add_bos = files.add_special_flag("bos")  # None: tokenizer_config does not say
        self._add_eos = files.add_special_flag("eos")
        self._eog = files.eog_ids()
        self._template = files.chat_template()
        self._piece_cache: dict[int, bytes] = {}
        self.path = files.directory
        self.vocab_size = max(files.vocab_size(), tokenizer.get_vocab_size(with_added_tokens=True))

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``parse_special`` lets special-token text become control tokens."""
        explicit = self._add_bos is not None or self._add_eos is not None
        try:
            with self._lock:
                self._tokenizer.encode_special_tokens = not parse_special
                encoding = self._tokenizer.encode(text, add_special_tokens=add_special and not explicit)
        except Exception as exc:  # tokenizers' own errors are bare Exceptions
            raise DecodeError(f"tokenization failed: {exc}") from None
        ids: list[int] = list(encoding.ids)
        if add_special and explicit:  # the flags replace the post-processor, as transformers does
            if self._add_bos and self._bos_id is not None:
                ids.insert(0, self._bos_id)
            if self._add_eos and self._eos_id is not None:
                ids.append(self._eos_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token: byte-level pieces mapped back to bytes; added tokens as UTF-8."""
        piece = self._piece_cache.get(token_id)
        if piece is None:
            piece = self._piece(token_id)
            self._piece_cache[token_id] = piece
        return piece

    def _piece(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")  # control and user-defined tokens are stored as plain text
        text = self._tokenizer.id_to_token(token_id)
        if text is None:
            return b""  # an embedding row past the tokenizer (padding): no text, as llama.cpp's UNUSED
        if self._byte_level:
            decoder = self._byte_decoder
            return b"".join(bytes([decoder[c]]) if c in decoder else c.encode("utf-8") for c in text)
        if self._sentencepiece:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes([int(text[3:5], 16)])  # byte-fallback token: one raw byte
            return text.replace("▁", " ").encode("utf-8")
        # WordPiece and other models: the decoder's text of the lone token (its bytes can't be split).
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def is_control(self, token_id: int) -> bool:
        """An added token marked special (``<|im_start|>``): never text a grammar may spell."""
        return token_id in self._control

    def is_eog(self, token_id: int) -> bool:
        """EOS ids of config.json, generation_config.json and tokenizer_config, or an end-of-turn token."""
        return token_id in self._eog

    def chat_template(self) -> str | None:
        return self._template

    def special_token_text(self, which: str) -> str:
        """Text of the ``bos`` or ``eos`` token (for chat templates); empty if the model has none."""
        if which not in ("bos", "eos"):
            raise ValueError(f"special token {which!r}: expected 'bos' or 'eos'")
        token = self._bos_id if which == "bos" else self._eos_id
        return self.token_bytes(token).decode("utf-8", errors="replace") if token is not None else ""

    def close(self) -> None:
        """Nothing native to free (the tokenizer is reclaimed with this object); drops the piece cache."""
        self._piece_cache.clear()
