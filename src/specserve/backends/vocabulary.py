"""A model's vocabulary alone (no weights): for a process that tokenizes and detokenizes but runs no model —
the API server beside an engine process, the Ray front."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def open_vocabulary(path: str | Path) -> Any:
    """The tokenizer of a checkpoint directory (Hugging Face ``tokenizers``, the torch runtime's) or of a GGUF
    (llama.cpp's, vocabulary only: the tokens either runtime gives for that file)."""
    path = Path(path)
    if path.is_dir():
        from specserve.backends.torch.hf_vocab import HFVocabulary

        return HFVocabulary(path)
    from specserve.backends.llama_cpp_vocab import LlamaCppVocabulary

    return LlamaCppVocabulary(path)
