"""llama.cpp runtime through llama-cpp-python's low-level (ctypes) API.

Why the low-level API: the engine needs logits rows for *chosen* positions of a batch that mixes several
sequences, and per-sequence KV truncation; the high-level ``Llama`` class offers neither.

Exactness (``exact=True``): greedy speculative output must equal plain greedy output token for token, which
needs the logits of a token to be bit-identical whether it is evaluated alone or inside a verify batch. In
ggml's CPU backend that holds when every matrix product computes each output row the same way whatever the
batch size. Stock ggml does not: repacked Q4_K weights run a gemv for one row and a gemm for 4 or 16, and
K-quants switch from vec_dot to a tiled kernel at 8 rows. Exact mode therefore runs in one of two ways
(``RuntimeInfo.exactness``):

* ``batch-invariant``: specserve's build patches those kernels (``patches/llama.cpp-batch-invariant.patch``,
  ggml feature ``BATCH_INVARIANT``), so weight repacking stays on and a call may hold any number of rows. A
  self-check at load (:mod:`specserve.backends.invariance`) proves it on the loaded model.
* ``capped``: where the build lacks the patch or the self-check fails (another weight type, another CPU),
  repacking is off and calls hold at most ``EXACT_MAX_ROWS`` rows, so every K-quant row runs vec_dot.

Stock ggml's flash attention accumulates the softmax in tiles whose shape depends on the number of query
rows (and splits the KV across threads for one row): capped mode turns it off, the patch gives it one kernel
for every batch size. ggml's plain attention (a product, a softmax, a product) sums each row in one fixed
order and is invariant in both modes; on the CPU it is the default (``uses_flash_attention``). Both need
llamafile's sgemm off (a build option: ``-DGGML_LLAMAFILE=OFF``). Sequences get separate KV streams
(``kv_unified=False``) so one sequence's cache layout, and hence the order of its attention sums, does not
depend on which other sequences share the batch.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specserve.backends.base import (
    DecodeChunk,
    DecodeError,
    Exactness,
    HostLogits,
    ModelLoadError,
    ModelRuntime,
    RuntimeInfo,
    StepLogits,
    chunk_piece,
    row_offsets,
)
from specserve.backends.invariance import check_batch_invariance, check_rows
from specserve.backends.llama_cpp_batch import LlamaBatch
from specserve.backends.llama_cpp_lib import llama_lib
from specserve.backends.llama_cpp_passes import stream_passes
from specserve.backends.llama_cpp_tiled import (
    TILED_SETTING,
    measure_tiled_min_batch,
    set_tiled_min_batch,
    tiled_min_batch,
    user_chose,
)
from specserve.backends.llama_cpp_vocab import VocabularyMethods
from specserve.config import FlashAttentionChoice

# Capped exact mode: ggml's CPU backend switches K-quant matrix products to a tiled kernel at 8 rows
# (ggml-cpu/tiled/tiled.cpp, ggml_tiled_min_batch); below that, without repacking, every row goes through the
# same vec_dot kernel as a one-token step.
EXACT_MAX_ROWS = 7
PLAN_CACHE_SIZE = 4096
"""Call plans and pass counts kept per chunk shape (a step's shapes repeat: the same call, priced and run)."""

log = logging.getLogger("specserve.llama_cpp")


def _kv_bytes_per_token(lib: Any, model: Any) -> int:
    """K and V rows of every layer in f16 (llama.cpp's default cache type); models whose K and V head sizes
    differ from n_embd / n_head are estimated."""
    n_head = max(1, int(lib.llama_model_n_head(model)))
    head_dim = int(lib.llama_model_n_embd(model)) // n_head
    return int(lib.llama_model_n_layer(model)) * 2 * int(lib.llama_model_n_head_kv(model)) * head_dim * 2


def uses_flash_attention(choice: FlashAttentionChoice, exactness: Exactness, gpu_layers: int) -> bool:
    """Whether a context gets llama.cpp's flash attention.

    ``auto`` turns it on only with layers on a GPU. On the CPU exact mode can use only flash attention's
    per-row kernel (the patch: its tiled and KV-split paths sum in other orders), and from about a thousand
    cached tokens on that kernel costs more than ggml's plain attention (a product, a softmax, a product: each
    row summed in one fixed order, so batch-invariant too, proved by the same self-check). On an AVX2 CPU the
    default target's verify passes cost up to a quarter less with plain attention and speculation on agent
    traces ran 1.09x faster; only prompt pieces below ~512 cached tokens are slower (docs/BENCHMARKS.md).
    Capped exact mode never uses it: stock ggml's flash attention is not invariant."""
    if exactness == "capped":
        return False
    return choice == "on" or (choice == "auto" and gpu_layers > 0)


def _features() -> str:
    return str(llama_lib().llama_print_system_info().decode(errors="replace"))


def build_is_batch_invariant() -> bool:
    """Whether the loaded llama.cpp was built with the batch-invariant patch (ggml CPU feature)."""
    return "BATCH_INVARIANT = 1" in _features()


class LlamaCppRuntime(VocabularyMethods, ModelRuntime[HostLogits]):
    """A GGUF model in llama.cpp with ``max_sequences`` independent KV streams."""

    def __init__(
        self,
        path: str | Path,
        *,
        context_per_sequence: int = 4096,
        max_sequences: int = 1,
        n_threads: int | None = None,
        exact: bool = True,
        batch_capacity: int = 512,
        n_gpu_layers: int = 0,
        self_check: bool = True,
        flash_attention: FlashAttentionChoice = "auto",
    ) -> None:
        """``self_check=False`` trusts the build's batch invariance without proving it on this model (a
        draft model: its logits only propose tokens, so they need not be exact). ``flash_attention``: see
        :func:`uses_flash_attention`."""
        from specserve.models import GGUFFileError, check_gguf_file

        path = Path(path)
        try:
            check_gguf_file(path)
        except GGUFFileError as exc:
            raise ModelLoadError(str(exc)) from exc
        self._lib = llama_lib()
        self._path = path
        self._options = (context_per_sequence, max_sequences, n_threads or max(1, os.cpu_count() or 1))
        self._gpu_layers = n_gpu_layers
        self._flash_attention = flash_attention
        self._requested_capacity = batch_capacity
        self._piece_cache: dict[int, bytes] = {}
        self._eog_cache: dict[int, bool] = {}
        self._closed = True
        if not exact:
            self._load("off")
        elif not build_is_batch_invariant():
            self._load(
                "capped", "this llama.cpp build lacks the batch-invariant patch (ggml BATCH_INVARIANT)"
            )
        else:
            self._load("batch-invariant")
            if self_check:
                try:
                    result = check_batch_invariance(self, rows=check_rows(tiled_min_batch()))
                except BaseException:
                    self._release()
                    raise
                if result.ok:
                    self.info = dataclasses.replace(self.info, exactness_note=result.describe())
                else:
                    note = f"batch-invariance self-check failed: {result.describe()}"
                    log.warning("%s; exact mode falls back to capped verify batches", note)
                    self._release()
                    self._load("capped", note)

    def tune_kernels(self, scratch_seq: int) -> dict[str, int]:
        """Where ggml's tiled K-quant kernel takes over from vec_dot, measured on this model and CPU
        (llama_cpp_tiled.py): not where the environment chose it, the build cannot move it, the weights are
        not repacked (capped exact mode: calls of at most 7 rows) or on a GPU."""
        if user_chose() or tiled_min_batch() is None or self.info.exactness == "capped" or self._gpu_layers:
            return {}
        choice = measure_tiled_min_batch(self, scratch_seq)
        log.info(
            "tiled K-quant kernel from %d rows (ms per call, tiled / vec_dot: %s)",
            choice.rows,
            ", ".join(
                f"{n}: {choice.tiled_seconds[n] * 1e3:.0f}/{choice.vec_dot_seconds[n] * 1e3:.0f}"
                for n in choice.tiled_seconds
            ),
        )
        return {TILED_SETTING: choice.rows}

    def restore_kernels(self, settings: Mapping[str, int]) -> None:
        rows = settings.get(TILED_SETTING)
        if rows and not user_chose() and tiled_min_batch() is not None:
            set_tiled_min_batch(int(rows))

    def _load(self, exactness: Exactness, note: str = "") -> None:
        """Load the model and create the context for one exactness mode (see the module docstring)."""
        lib = self._lib
        context_per_sequence, max_sequences, threads = self._options
        mparams = lib.llama_model_default_params()
        mparams.n_gpu_layers = self._gpu_layers
        mparams.use_extra_bufts = exactness != "capped"
        self._model = lib.llama_model_load_from_file(str(self._path).encode(), mparams)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {self._path}: not a supported GGUF model")

        cparams = lib.llama_context_default_params()
        cparams.n_ctx = context_per_sequence * max_sequences
        cparams.n_batch = self._requested_capacity
        cparams.n_ubatch = self._requested_capacity
        cparams.n_seq_max = max_sequences
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.kv_unified = False
        cparams.no_perf = True
        flash = uses_flash_attention(self._flash_attention, exactness, self._gpu_layers)
        cparams.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_AUTO if flash else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise ModelLoadError(
                f"llama.cpp could not create a context for {self._path} (n_ctx={cparams.n_ctx})"
            )

        self._vocab = lib.llama_model_get_vocab(self._model)
        self._memory = lib.llama_get_memory(self._ctx)
        # llama.cpp caps n_batch at the context size; a larger batch would abort the process (GGML_ASSERT).
        self._capacity = min(self._requested_capacity, int(lib.llama_n_batch(self._ctx)))
        desc = ctypes.create_string_buffer(256)
        lib.llama_model_desc(self._model, desc, 256)
        self.info = RuntimeInfo(
            path=str(self._path),
            description=desc.value.decode(errors="replace"),
            vocab_size=int(lib.llama_vocab_n_tokens(self._vocab)),
            # llama.cpp pads the context; the engine keeps to what was asked for.
            context_per_sequence=min(context_per_sequence, int(lib.llama_n_ctx_seq(self._ctx))),
            max_sequences=max_sequences,
            n_threads=threads,
            exact=exactness != "off",
            max_verify_tokens=EXACT_MAX_ROWS if exactness == "capped" else self._capacity,
            exactness=exactness,
            exactness_note=note,
            kv_bytes_per_token=_kv_bytes_per_token(lib, self._model),
            # flash attention changes what each call size costs: a calibration is kept per choice
            build=f"{_features()}FLASH_ATTN = {int(flash)} | ",
        )
        self._batch = LlamaBatch(lib, self._capacity)
        self._logits_views: dict[int | None, HostLogits] = {}
        self._plans: dict[tuple[int, ...], list[list[tuple[int, int, int]]]] = {}
        self._passes: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ...]] = {}
        self._closed = False

    # -- evaluation -------------------------------------------------------------------------------

    def decode(self, chunks: Sequence[DecodeChunk]) -> StepLogits[HostLogits]:
        if self._closed:  # llama.cpp would read freed memory
            raise DecodeError(f"{self._path.name}: the runtime is closed")
        calls = [
            [(index, chunk_piece(chunks[index], lo, hi)) for index, lo, hi in call]
            for call in self._pack([len(c.tokens) for c in chunks])
        ]
        offsets = row_offsets([c.num_logits for c in chunks])
        if len(calls) == 1:  # the common case: the rows stay in llama.cpp's buffer, in chunk order
            return StepLogits(self._decode_one([piece for _, piece in calls[0]]), offsets)
        # Several llama_decode calls: copy logits out after each, as every call overwrites the buffer.
        rows = np.empty((offsets[-1], self.info.vocab_size), np.float32)
        filled = list(offsets[:-1])  # next free row of each chunk
        for call in calls:
            logits = self._decode_one([piece for _, piece in call])
            row = 0
            for index, piece in call:
                n = piece.num_logits
                rows[filled[index] : filled[index] + n] = logits[row : row + n]
                filled[index] += n
                row += n
        return StepLogits(rows, offsets)

    def call_rows(self, chunk_rows: Sequence[int], seq_ids: Sequence[int] | None = None) -> list[int]:
        """Rows of each pass: per ``llama_decode`` call of ``_pack``, the micro-batches llama.cpp splits it
        into over the sequences' KV streams (llama_cpp_passes.py; one per call with a single stream)."""
        ids = tuple(range(len(chunk_rows)) if seq_ids is None else seq_ids)
        key = (tuple(chunk_rows), ids)
        cached = self._passes.get(key)
        if cached is not None:
            return list(cached)
        passes: list[int] = []
        for call in self._pack(chunk_rows):
            if self.info.max_sequences == 1:
                passes.append(sum(hi - lo for _, lo, hi in call))
            else:
                passes += stream_passes(sorted((ids[i], hi - lo) for i, lo, hi in call), self._capacity)
        if len(self._passes) >= PLAN_CACHE_SIZE:  # a step's shapes repeat; the policy asks many
            self._passes.clear()
        self._passes[key] = tuple(passes)
        return passes

    def _pack(self, chunk_rows: Sequence[int]) -> list[list[tuple[int, int, int]]]:
        """Group chunks, cut to the batch capacity, into llama_decode calls: per call, its pieces as
        ``(chunk index, first row, end row)``. ``decode`` runs exactly this plan and ``call_rows`` prices it.

        Capped exact mode keeps every row's kernel independent of its batch-mates: unpatched ggml computes
        K-quant matrix products of 8 or more rows with a tiled kernel whose rounding differs from the
        row-by-row kernel used below 8 rows. So a piece of 8+ rows (a prompt chunk) gets a call of its own —
        as it would alone — and smaller pieces (verify chunks, a short prompt tail) share calls of at most
        ``EXACT_MAX_ROWS`` rows.

        Example (capped, capacity 512): chunks of ``[300, 3, 5, 2]`` rows make the calls
        ``[(0, 0, 300)]``, ``[(1, 0, 3)]``, ``[(2, 0, 5), (3, 0, 2)]``: 3 + 5 > 7 starts a new call.
        """
        key = tuple(chunk_rows)
        if (cached := self._plans.get(key)) is not None:
            return cached
        limit = EXACT_MAX_ROWS if self.info.exactness == "capped" else self._capacity
        calls: list[list[tuple[int, int, int]]] = []
        current: list[tuple[int, int, int]] = []
        used = 0
        for index, rows in enumerate(chunk_rows):
            for lo in range(0, rows, self._capacity):
                hi = min(lo + self._capacity, rows)
                n = hi - lo
                if n > limit:
                    calls.append([(index, lo, hi)])
                    continue
                if used + n > limit:
                    calls.append(current)
                    current, used = [], 0
                current.append((index, lo, hi))
                used += n
        if current:
            calls.append(current)
        if len(self._plans) >= PLAN_CACHE_SIZE:
            self._plans.clear()
        self._plans[key] = calls
        return calls

    def _decode_one(self, chunks: Sequence[DecodeChunk]) -> HostLogits:
        """One llama_decode call; the logits rows asked for, in chunk order (a view of llama.cpp's buffer,
        or a copy where the call's tokens were reordered: they go in sequence order, llama_cpp_batch.py)."""
        order = self._batch.fill(chunks)
        rc = self._lib.llama_decode(self._ctx, self._batch.batch)
        if rc != 0:
            raise DecodeError(
                f"llama_decode failed with code {rc} (batch of {self._batch.batch.n_tokens} tokens; "
                "1 = KV cache full)"
            )
        n_out = sum(c.num_logits for c in chunks)
        if n_out == 0:
            return np.empty((0, self.info.vocab_size), np.float32)
        logits = self._logits_view(n_out)
        if order is None:
            return logits
        written = row_offsets([chunks[j].num_logits for j in order])  # rows in the order they were written
        start = dict(zip(order, written[:-1], strict=True))
        rows = [r for j in range(len(chunks)) for r in range(start[j], start[j] + chunks[j].num_logits)]
        return logits[rows]

    def _logits_view(self, rows: int) -> HostLogits:
        """The first ``rows`` rows of llama.cpp's logits buffer, as numpy (no copy). The view is made once
        per buffer (``as_array`` builds a ctypes array type each call: microseconds every step); llama.cpp
        reallocates the buffer only when a call outputs more rows than any before."""
        ptr = self._lib.llama_get_logits(self._ctx)
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        view = self._logits_views.get(address)
        if view is None or view.shape[0] < rows:  # a new buffer, or more rows than viewed before
            view = np.ctypeslib.as_array(ptr, shape=(rows, self.info.vocab_size))
            self._logits_views = {address: view}
        return view[:rows]

    def truncate(self, seq_id: int, length: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, seq_id, length, -1)

    def kv_positions(self, seq_id: int) -> int:
        return int(self._lib.llama_memory_seq_pos_max(self._memory, seq_id)) + 1

    def free(self, seq_id: int) -> None:
        self._lib.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    def copy_sequence(self, src: int, dst: int, length: int) -> bool:
        # With one KV stream per sequence (kv_unified=False) llama.cpp copies only whole streams (a partial
        # copy fails an assertion and aborts the process): copy it all, then cut the tail. The data moves at
        # the start of the next llama_decode, before that batch writes anything.
        lib = self._lib
        lib.llama_memory_seq_rm(self._memory, dst, -1, -1)
        lib.llama_memory_seq_cp(self._memory, src, dst, -1, -1)
        lib.llama_memory_seq_rm(self._memory, dst, length, -1)
        return True

    def save_sequence(self, seq_id: int) -> bytes | None:
        lib = self._lib
        size = int(lib.llama_state_seq_get_size(self._ctx, seq_id))
        data = bytearray(size)
        written = int(
            lib.llama_state_seq_get_data(self._ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq_id)
        )
        return bytes(memoryview(data)[:written]) if written else None

    def load_sequence(self, seq_id: int, blob: bytes) -> int:
        lib = self._lib
        lib.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if not lib.llama_state_seq_set_data(self._ctx, buf, len(blob), seq_id):
            lib.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            return 0
        return self.kv_positions(seq_id)

    def close(self) -> None:
        if self._closed:
            return
        self._release()

    def _release(self) -> None:
        self._closed = True
        self._batch.free()
        self._lib.llama_free(self._ctx)
        self._lib.llama_model_free(self._model)

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False:
            self.close()
