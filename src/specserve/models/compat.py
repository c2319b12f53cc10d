"""Can a draft model speculate for a target model? Their vocabularies must agree.

Speculative decoding hands draft token ids straight to the target, so an id must mean the same text in both
models. The rule follows llama.cpp's `common_speculative_are_compatible`: the same tokenizer model, the same
BOS/EOS ids, vocabulary sizes within SPEC_VOCAB_MAX_SIZE_DIFFERENCE of each other (models of one family
often pad the embedding table differently), and the same text for every id the two share. Control tokens
are skipped in that last comparison: they are never proposed as ordinary text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specserve.models.errors import GGUFFileError, IncompatibleVocabError
from specserve.models.gguf_header import check_gguf_file, read_header
from specserve.models.hf_dir import read_hf_vocab
from specserve.models.vocab_info import VocabInfo

__all__ = [
    "SPEC_VOCAB_MAX_SIZE_DIFFERENCE",
    "VocabInfo",
    "check_draft_compatible",
    "check_gguf_file",
    "read_vocab",
]

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128  # as in llama.cpp

_KEYS = (
    "general.architecture",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
)


def read_vocab(path: Path | str) -> VocabInfo:
    """Read the vocabulary of a GGUF file from its header (no tensor data is touched), or of a Hugging Face
    checkpoint directory from its tokenizer files (:func:`~specserve.models.hf_dir.read_hf_vocab`)."""
    if Path(path).expanduser().is_dir():
        return read_hf_vocab(path)  # a directory without config.json gets its one-line refusal there
    header = read_header(path, keys=_KEYS)
    meta = header.metadata
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, tuple):
        raise GGUFFileError(f"{header.path}: no tokenizer.ggml.tokens in the GGUF metadata")
    token_types = meta.get("tokenizer.ggml.token_type")
    return VocabInfo(
        path=header.path,
        architecture=_opt_str(meta.get("general.architecture")),
        tokenizer_model=_opt_str(meta.get("tokenizer.ggml.model")),
        tokenizer_pre=_opt_str(meta.get("tokenizer.ggml.pre")),
        tokens=tokens,
        token_types=tuple(int(t) for t in token_types) if token_types is not None else (),
        bos_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
        add_bos=None if (flag := meta.get("tokenizer.ggml.add_bos_token")) is None else bool(flag),
    )


def check_draft_compatible(target: VocabInfo, draft: VocabInfo) -> None:
    """Raise IncompatibleVocabError naming every difference that makes `draft` unusable for `target`."""
    problems = []
    if target.tokenizer_model != draft.tokenizer_model:
        problems.append(f"tokenizer model {target.tokenizer_model!r} vs {draft.tokenizer_model!r}")
    for what, t_id, d_id in (("bos", target.bos_id, draft.bos_id), ("eos", target.eos_id, draft.eos_id)):
        if t_id != d_id:
            problems.append(f"{what} token id {t_id} vs {d_id}")
    if target.add_bos is not None and draft.add_bos is not None and target.add_bos != draft.add_bos:
        problems.append(f"add_bos_token {target.add_bos} vs {draft.add_bos}")
    if target.fingerprint != draft.fingerprint:
        size_difference = abs(target.n_vocab - draft.n_vocab)
        if size_difference > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
            problems.append(
                f"vocab size {target.n_vocab} vs {draft.n_vocab} differs by {size_difference} "
                f"(at most {SPEC_VOCAB_MAX_SIZE_DIFFERENCE} allowed)"
            )
        mismatch = _first_text_mismatch(target, draft)
        if mismatch is not None:
            token_id, t_text, d_text = mismatch
            problems.append(f"token {token_id} is {t_text!r} in the target but {d_text!r} in the draft")
    if problems:
        raise IncompatibleVocabError(
            f"draft {draft.path.name} cannot speculate for target {target.path.name}: " + "; ".join(problems)
        )


def _first_text_mismatch(target: VocabInfo, draft: VocabInfo) -> tuple[int, str, str] | None:
    """The first shared, non-control id whose text differs, as (id, target text, draft text)."""
    n_shared = min(target.n_vocab, draft.n_vocab)
    if target.tokens[:n_shared] == draft.tokens[:n_shared]:
        return None  # the common case, compared at C speed
    for token_id in range(n_shared):
        t_text, d_text = target.tokens[token_id], draft.tokens[token_id]
        if t_text != d_text and not (target.is_control(token_id) or draft.is_control(token_id)):
            return token_id, t_text, d_text
    return None


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
