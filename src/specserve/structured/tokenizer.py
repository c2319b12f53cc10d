"""The target's vocabulary as llguidance needs it: every token's bytes, control tokens marked, the
end-of-generation ids, and the tokenizer itself (llguidance tokenizes forced text with it)."""

from __future__ import annotations

from typing import Any, Protocol


class GrammarVocabulary(Protocol):
    """What a runtime offers the grammar engine (a ModelRuntime has all of it)."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_eog(self, token_id: int) -> bool: ...

    def is_control(self, token_id: int) -> bool: ...


CONTROL_PREFIX = b"\xff"
"""llguidance's mark of a special token: such a token never spells grammar text, only ``<[id]>`` names it."""


def eog_ids(vocabulary: GrammarVocabulary, vocab_size: int) -> list[int]:
    """The end-of-generation token ids, ascending."""
    return [token for token in range(vocab_size) if vocabulary.is_eog(token)]


class _Wrapper:
    """llguidance's TokenizerWrapper protocol: the token list, EOS/BOS and a text → ids call."""

    def __init__(self, vocabulary: GrammarVocabulary, vocab_size: int) -> None:
        self._vocabulary = vocabulary
        self.tokens: list[bytes] = []
        eog = eog_ids(vocabulary, vocab_size)
        ends = frozenset(eog)
        for token in range(vocab_size):
            piece = vocabulary.token_bytes(token)
            if token in ends or vocabulary.is_control(token):
                piece = CONTROL_PREFIX + (piece or f"<[{token}]>".encode())
            self.tokens.append(piece)
        self.eos_ids = eog
        self.eos_token_id = eog[0] if eog else vocab_size - 1
        self.bos_token_id = None
        self.special_token_ids = [t for t, p in enumerate(self.tokens) if p.startswith(CONTROL_PREFIX)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="surrogateescape")
        try:
            return self._vocabulary.tokenize(text, add_special=False, parse_special=False)
        except UnicodeEncodeError:  # a cut multi-byte character: llguidance then tokenizes it greedily
            raise ValueError("not valid UTF-8") from None


def llg_tokenizer(vocabulary: GrammarVocabulary, vocab_size: int) -> tuple[Any, list[int]]:
    """An ``llguidance.LLTokenizer`` for the target and its end-of-generation ids (about a second for a 150k
    vocabulary; build it once)."""
    import llguidance

    wrapper = _Wrapper(vocabulary, vocab_size)
    tokenizer = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=wrapper.eos_ids or None
    )
    return tokenizer, wrapper.eos_ids
