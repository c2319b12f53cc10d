"""A runtime whose forward pass costs nothing: fixed logits at a real vocabulary's width.

What the engine spends around the model (scheduling, drafting, verification over 151,936-wide rows,
commit, detokenizing) is then all there is to time. The logits at position ``p`` are one of ``len(cycle)``
fixed rows of random logits, the one where ``cycle[(p + 1) % len(cycle)]`` is far ahead of every other
token: greedy decoding emits the cycle forever, and an n-gram drafter that has seen it (a prompt of the
cycle) drafts it with every draft accepted, so a step's work is the same from the first step to the last.
The text side (tokenizing, token bytes, the chat template) is another runtime's, a real vocabulary loaded
from a GGUF; ids past it are never emitted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from specserve.backends.base import (
    DecodeChunk,
    HostRuntime,
    ModelRuntime,
    StepLogits,
    row_offsets,
)

QWEN_VOCAB = 151_936
"""Qwen2.5's vocabulary: the width of the default models' logits rows."""
BUILT_BYTES = 2 << 30
"""Logits kept for patterns of rows already built (past it, each step copies its rows afresh)."""


class NullRuntime(ModelRuntime[Any]):
    """Fixed logits ``[rows, vocab_size]`` float32, as numpy (``torch=False``) or as a CPU torch tensor;
    each row is a copy of the table row its position picks (the copy is the forward pass's whole cost)."""

    def __init__(
        self,
        text: HostRuntime,
        cycle: Sequence[int],
        vocab_size: int = QWEN_VOCAB,
        max_sequences: int = 32,
        context_per_sequence: int = 1 << 20,
        torch: bool = False,
    ) -> None:
        if not cycle or not all(0 <= t < text.info.vocab_size for t in cycle):
            raise ValueError("the cycle needs tokens of the text runtime's vocabulary")
        self._text = text
        self.cycle = list(cycle)
        self.info = dataclasses.replace(
            text.info,
            description=f"null runtime ({vocab_size}-wide logits, {'torch' if torch else 'numpy'})",
            vocab_size=vocab_size,
            max_sequences=max_sequences,
            context_per_sequence=context_per_sequence,
            logits_device="torch:cpu" if torch else "cpu",
            build="null",
        )
        self._torch = torch
        self._table: Any = self._logits()
        self._built: dict[tuple[int, ...], Any] = {}
        self._built_bytes = 0
        self._positions = [0] * max_sequences

    def _logits(self) -> Any:
        """``[len(cycle), vocab]``: row ``i`` favours ``cycle[(i + 1) % len(cycle)]``."""
        row = np.random.default_rng(0).standard_normal(self.info.vocab_size).astype(np.float32)
        table = np.repeat(row[None, :], len(self.cycle), axis=0)
        for i in range(len(self.cycle)):
            table[i, self.cycle[(i + 1) % len(self.cycle)]] = 30.0  # far ahead: greedy and sampled alike
        if not self._torch:
            return table
        import torch

        return torch.from_numpy(table)

    # -- the forward pass -----------------------------------------------------------------------------

    def decode(self, chunks: Sequence[DecodeChunk]) -> StepLogits[Any]:
        wanted = [c.num_logits for c in chunks]
        picks: list[int] = []
        for c in chunks:
            if c.start_pos != self._positions[c.seq_id]:
                raise ValueError(
                    f"sequence {c.seq_id}: write at {c.start_pos}, holds {self._positions[c.seq_id]}"
                )
            end = c.start_pos + len(c.tokens)
            self._positions[c.seq_id] = end
            picks.extend(p % len(self.cycle) for p in range(end - c.num_logits, end))
        return StepLogits(self._rows(tuple(picks)), row_offsets(wanted))

    def _rows(self, picks: tuple[int, ...]) -> Any:
        """The rows of these table picks, built once: sequences decoding in lockstep ask for a few
        patterns again and again, and a fresh copy of 288 such rows is 175 MB written per step."""
        rows = self._built.get(picks)
        if rows is None:
            if self._torch:
                import torch

                rows = self._table.index_select(0, torch.tensor(picks, dtype=torch.int64))
            else:
                rows = self._table.take(picks, axis=0)
            if self._built_bytes + 4 * rows.shape[0] * rows.shape[1] <= BUILT_BYTES:
                self._built[picks] = rows
                self._built_bytes += 4 * rows.shape[0] * rows.shape[1]
        return rows

    def truncate(self, seq_id: int, length: int) -> None:
        self._positions[seq_id] = min(self._positions[seq_id], length)

    def free(self, seq_id: int) -> None:
        self._positions[seq_id] = 0

    def kv_positions(self, seq_id: int) -> int:
        return self._positions[seq_id]

    def close(self) -> None:
        """The text runtime is the caller's to close."""

    # -- text: the real vocabulary's ------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self._text.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token_id: int) -> bytes:
        return self._text.token_bytes(token_id) if token_id < self._text.info.vocab_size else b""

    def is_eog(self, token_id: int) -> bool:
        return token_id < self._text.info.vocab_size and self._text.is_eog(token_id)

    def is_control(self, token_id: int) -> bool:
        return token_id < self._text.info.vocab_size and self._text.is_control(token_id)

    def chat_template(self) -> str | None:
        return self._text.chat_template()

    def special_token_text(self, which: str) -> str:
        return self._text.special_token_text(which)
