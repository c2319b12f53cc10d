"""A GGUF model's vocabulary in llama.cpp: tokenizing, token pieces, the chat template.

``VocabularyMethods`` serves both the full runtime and :class:`LlamaCppVocabulary`, which loads the vocabulary
alone (``vocab_only``: no weights, no KV cache, a few MB and milliseconds). A front-end that only tokenizes —
the Ray Serve front, which routes requests by the block hashes of their prompt tokens — uses the latter.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from specserve.backends.base import DecodeError, ModelLoadError
from specserve.backends.llama_cpp_lib import llama_lib

_ATTR_CONTROL = 8  # llama.cpp's LLAMA_TOKEN_ATTR_CONTROL


class VocabularyMethods:
    """Tokenizer methods over ``self._lib`` (llama_cpp), ``self._model`` and ``self._vocab``."""

    _lib: Any
    _model: Any
    _vocab: Any
    _piece_cache: dict[int, bytes]
    _eog_cache: dict[int, bool]

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 16
        for _ in range(2):
            buf = (ctypes.c_int32 * size)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), buf, size, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            size = -n
        raise DecodeError("tokenization failed")

    def token_bytes(self, token_id: int) -> bytes:
        piece = self._piece_cache.get(token_id)
        if piece is None:
            buf = ctypes.create_string_buffer(256)
            n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, 256, 0, True)
            piece = buf.raw[: max(n, 0)]
            self._piece_cache[token_id] = piece
        return piece

    def is_eog(self, token_id: int) -> bool:
        eog = self._eog_cache.get(token_id)
        if eog is None:
            eog = bool(self._lib.llama_vocab_is_eog(self._vocab, token_id))
            self._eog_cache[token_id] = eog
        return eog

    def is_control(self, token_id: int) -> bool:
        return bool(self._lib.llama_vocab_get_attr(self._vocab, token_id) & _ATTR_CONTROL)

    def chat_template(self) -> str | None:
        raw = self._lib.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8", errors="replace") if raw else None

    def special_token_text(self, which: str) -> str:
        fn = {"bos": self._lib.llama_vocab_bos, "eos": self._lib.llama_vocab_eos}[which]
        token = int(fn(self._vocab))
        return self.token_bytes(token).decode("utf-8", errors="replace") if token >= 0 else ""


class LlamaCppVocabulary(VocabularyMethods):
    """The vocabulary of a GGUF model, loaded without its weights."""

    def __init__(self, path: str | Path) -> None:
        self._lib = llama_lib()
        params = self._lib.llama_model_default_params()
        params.vocab_only = True
        self._model = self._lib.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load the vocabulary of {path}")
        self._vocab = self._lib.llama_model_get_vocab(self._model)
        self._piece_cache = {}
        self._eog_cache = {}
        self.vocab_size = int(self._lib.llama_vocab_n_tokens(self._vocab))

    def close(self) -> None:
        if self._model:
            self._lib.llama_model_free(self._model)
            self._model = None
