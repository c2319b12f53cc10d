"""The model runtime interface: what the engine needs from a backend, and nothing more.

A runtime holds one model and one KV cache with room for ``max_sequences`` independent sequences. The engine
owns all token accounting; the runtime only appends tokens at positions it is told, returns logits rows, and
truncates or frees a sequence's cache. That keeps rollback of rejected draft tokens a single ``truncate``.

llama.cpp implements it today (:mod:`specserve.backends.llama_cpp`). The interface is generic in where a
runtime keeps its logits (``LogitsT``): llama.cpp hands back numpy arrays on the host, a GPU runtime keeps
tensors on its device. The engine never looks inside them; it passes them to the verifier made for them
(``specserve.verify``), so logits never have to leave the device. Code that reads logits itself (the draft
model drafter, the calibration self-check, the tools) takes a :data:`HostRuntime`.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from specserve.errors import UserError


class BackendError(UserError):
    """A backend failure with a one-line message for the user (bad model file, decode failure)."""


class ModelLoadError(BackendError):
    """The model file is missing, truncated, not a GGUF model, or could not be loaded."""


class DecodeError(BackendError):
    """The runtime could not evaluate a batch (for example the KV cache is full)."""


@dataclass(frozen=True)
class DecodeChunk:
    """Tokens of one sequence to append in a batched decode.

    ``tokens[i]`` is written at position ``start_pos + i`` of sequence ``seq_id``; logits are returned for the
    last ``num_logits`` tokens (0 for a prefill chunk that is not the last one).
    """

    seq_id: int
    tokens: Sequence[int]
    start_pos: int
    num_logits: int

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("a decode chunk needs at least one token")
        if not 0 <= self.num_logits <= len(self.tokens):
            raise ValueError(f"num_logits={self.num_logits} outside [0, {len(self.tokens)}]")


Exactness = Literal["batch-invariant", "capped", "off"]
"""How a runtime keeps a token's logits independent of its batch (``off``: it does not try)."""


@dataclass(frozen=True)
class RuntimeInfo:
    """Static facts about a loaded model."""

    path: str
    description: str
    vocab_size: int
    context_per_sequence: int
    max_sequences: int
    n_threads: int
    exact: bool
    max_verify_tokens: int = 1 << 16
    """Longest verify chunk (pending token + drafts) whose logits equal one-token steps bit for bit; the
    engine never drafts more than this minus one. Bounded only in ``capped`` exact mode."""
    exactness: Exactness = "off"
    """``batch-invariant``: any batch size is exact; ``capped``: only calls of at most ``max_verify_tokens``
    rows are (and longer chunks run alone); ``off``: no promise (fast mode)."""
    exactness_note: str = ""
    """Why this mode: the self-check's outcome, or why it fell back to ``capped``."""
    kv_bytes_per_token: int = 0
    """KV cache bytes one token of one sequence takes (an estimate; 0 if unknown)."""
    logits_device: str = "cpu"
    """Where ``decode`` leaves the logits: ``cpu`` (numpy arrays) or a device name (``cuda``, tensors there);
    the engine picks the verifier that works where they are."""
    build: str = ""
    """What the runtime's kernels are (llama.cpp: its CPU features, e.g. ``AVX512 = 1``, ``TILED_MIN_BATCH =
    32``): two builds of one model cost differently per call size, so a cost calibration is kept per build."""


LogitsT = TypeVar("LogitsT")
HostLogits = npt.NDArray[np.float32]
"""Logits rows on the host: ``[rows, vocab]`` float32."""


@dataclass(frozen=True)
class StepLogits(Generic[LogitsT]):
    """The logits one ``decode`` returns: every row asked for, chunk after chunk, in one array.

    Chunk ``i``'s rows are ``rows[offsets[i] : offsets[i + 1]]`` (``self[i]``); a chunk that asked for none
    has an empty slice. Keeping them in one array is what a batched verifier wants: the emitting chunks'
    rows back to back, as vLLM's rejection sampler lays out its input.

    Example: chunks asking for 0, 4 and 1 rows give ``offsets == (0, 0, 4, 5)`` and ``rows`` of 5 rows.
    """

    rows: LogitsT
    """``[num_rows, vocab]`` float32: numpy on the host, or a tensor on the runtime's device."""
    offsets: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, chunk: int) -> LogitsT:
        if not 0 <= chunk < len(self):
            raise IndexError(f"chunk {chunk} of {len(self)}")
        return self.rows[self.offsets[chunk] : self.offsets[chunk + 1]]  # type: ignore[index, no-any-return]

    def __iter__(self) -> Iterator[LogitsT]:
        return (self[i] for i in range(len(self)))


def row_offsets(rows_per_chunk: Sequence[int]) -> tuple[int, ...]:
    """``[0, 4, 1]`` → ``(0, 0, 4, 5)``: where each chunk's rows start in a :class:`StepLogits`."""
    return tuple(itertools.accumulate(rows_per_chunk, initial=0))


def chunk_piece(chunk: DecodeChunk, lo: int, hi: int) -> DecodeChunk:
    """Rows ``lo:hi`` of a chunk, for a runtime that splits a long chunk over several calls; a piece wants
    logits only where it holds the chunk's last tokens.

    Example: a 10-token chunk wanting 2 logits → pieces ``0:8`` (0 logits) and ``8:10`` (2 logits).
    """
    if lo == 0 and hi == len(chunk.tokens):
        return chunk
    want = min(hi - lo, max(0, chunk.num_logits - (len(chunk.tokens) - hi)))
    return DecodeChunk(chunk.seq_id, chunk.tokens[lo:hi], chunk.start_pos + lo, want)


def to_host(rows: object) -> HostLogits:
    """Logits rows as a float32 numpy array on the host: numpy as it is, a tensor copied off its device.

    For code that reads logits itself (the self-check, the draft model's confidence, the tools); the
    engine's own step never calls it.
    """
    if isinstance(rows, np.ndarray):
        return rows
    host: HostLogits = rows.detach().float().cpu().numpy()  # type: ignore[attr-defined]
    return host


def one_call(chunk_rows: Sequence[int], seq_ids: Sequence[int] | None = None) -> list[int]:
    """The packing of a runtime that evaluates a whole step in one call: ``[sum(chunk_rows)]``."""
    total = sum(chunk_rows)
    return [total] if total else []


class Vocabulary(Protocol):
    """What tokenizing and chat templating need: a ModelRuntime, or a vocabulary loaded alone."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def chat_template(self) -> str | None: ...

    def special_token_text(self, which: str) -> str: ...

    def is_control(self, token_id: int) -> bool: ...


def detokenize(vocabulary: Vocabulary, token_ids: Sequence[int]) -> str:
    """Text of a token sequence in any vocabulary; a cut multi-byte character becomes U+FFFD."""
    return b"".join(vocabulary.token_bytes(t) for t in token_ids).decode("utf-8", errors="replace")


class ModelRuntime(ABC, Generic[LogitsT]):
    """One model with a multi-sequence KV cache, returning logits of type ``LogitsT``."""

    info: RuntimeInfo

    @abstractmethod
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special`` adds BOS where the model wants one."""

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (may be part of a multi-byte UTF-8 character)."""

    @abstractmethod
    def is_eog(self, token_id: int) -> bool:
        """Whether the token ends generation (EOS, EOT, <|im_end|> ...)."""

    def is_control(self, token_id: int) -> bool:
        """Whether the token is a control token (``<|im_start|>``), never part of generated text."""
        return False

    @abstractmethod
    def chat_template(self) -> str | None:
        """The model's Jinja chat template from its metadata, if any."""

    @abstractmethod
    def special_token_text(self, which: str) -> str:
        """Text of the ``bos`` or ``eos`` token (for chat templates); empty if the model has none."""

    @abstractmethod
    def decode(self, chunks: Sequence[DecodeChunk]) -> StepLogits[LogitsT]:
        """Evaluate all chunks in one batch; chunk ``i``'s logits ``[num_logits, vocab]`` are ``result[i]``.

        The rows may be a view into the runtime's buffer: valid until the next ``decode`` call.
        """

    def call_rows(self, chunk_rows: Sequence[int], seq_ids: Sequence[int] | None = None) -> list[int]:
        """Rows of each pass over the weights that ``decode`` makes for chunks of these sizes, in this
        order, of these sequences (where the passes depend on them: llama.cpp's KV streams; None: distinct
        sequences with consecutive ids, the cheapest case).

        The draft policy prices a step with it (the cost of a step is the sum over its passes), so it must
        pack exactly as ``decode`` does. Default: one call for the whole batch.
        """
        return one_call(chunk_rows)

    def synchronize(self) -> None:
        """Wait until the last ``decode`` has finished on the device (for timing it)."""

    def tune_kernels(self, scratch_seq: int) -> dict[str, int]:
        """Measure and apply the kernel settings that run the loaded model fastest on this machine (settings
        of speed, never of values), using ``scratch_seq`` and leaving it empty; returns them, so that a cache
        can restore them in a later process. Default: nothing to tune."""
        return {}

    def restore_kernels(self, settings: Mapping[str, int]) -> None:
        """Apply settings an earlier :meth:`tune_kernels` returned on this machine (unknown keys ignored)."""

    def last_decode_seconds(self) -> float | None:
        """How long the last ``decode`` took where it ran, if the runtime measures that itself (a device
        runtime returns before its work is done; read after its results were used); None: the caller's
        wall clock around ``decode`` is the measure."""
        return None

    @abstractmethod
    def truncate(self, seq_id: int, length: int) -> None:
        """Forget positions ``>= length`` of a sequence (rollback of rejected draft tokens)."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Forget a whole sequence; its slot can be reused."""

    @abstractmethod
    def close(self) -> None:
        """Release the model and its cache."""

    @abstractmethod
    def kv_positions(self, seq_id: int) -> int:
        """Positions the sequence's KV holds (0: empty); what ``truncate`` and ``free`` leave behind."""

    # -- KV reuse across requests (the prefix cache); a runtime without it keeps these defaults ----------

    def copy_sequence(self, src: int, dst: int, length: int) -> bool:
        """Make ``dst`` hold the first ``length`` positions of ``src``'s KV; False if unsupported."""
        return False

    def save_sequence(self, seq_id: int) -> bytes | None:
        """A blob of the sequence's whole KV for :meth:`load_sequence`; None if unsupported."""
        return None

    def load_sequence(self, seq_id: int, blob: bytes) -> int:
        """Replace the sequence's KV with a saved blob; returns the positions it now holds (0: failed)."""
        return 0

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Text of a token sequence; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return detokenize(self, token_ids)


HostRuntime = ModelRuntime[HostLogits]
"""A runtime whose logits are numpy arrays on the host (llama.cpp), for code that reads them itself."""
