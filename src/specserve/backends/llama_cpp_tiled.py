"""Where ggml's tiled K-quant kernel takes over from vec_dot: read, set, and measured on this CPU.

A K-quant matrix product of a few rows runs ggml's ``vec_dot`` kernel, one of many rows its tiled kernel.
In specserve's build both compute the same values (``patches/llama.cpp-batch-invariant.patch``), so the
switch is a matter of speed, and where the tiled kernel starts to pay depends on the CPU: on AMD EPYC Zen 4
it cost 1.2-1.4x vec_dot at 8-12 verify rows (the "8-row cliff" of issue 20), on Zen 5 with AVX-512 it is
cheaper from 12 rows by up to a quarter, in an AVX2-only build on Zen 5 from 16 (docs/BENCHMARKS.md). A
fixed start is wrong somewhere, so the patch lets a program set it (``ggml_cpu_set_tiled_min_batch``) and
:func:`measure_tiled_min_batch` times verify-sized calls with each kernel to choose it.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specserve.backends.base import DecodeChunk, ModelRuntime
from specserve.backends.llama_cpp_lib import ggml_cpu_lib

TILED_SETTING = "tiled_min_batch"
"""The setting's name among a runtime's tuned kernel settings (``ModelRuntime.tune_kernels``)."""
ENVIRONMENT = "GGML_CPU_TILED_MM_MIN_BATCH"
"""ggml reads it where no program sets the start: a user's or a benchmark's choice, never measured over."""
SIZES = (8, 12, 16, 24)
"""Calls timed with each kernel: the verify sizes between the two kernels' usual starts (8 and 32)."""
CANDIDATES = (8, 12, 16, 24, 32)
TOLERANCE = 1.03
"""The tiled kernel counts as no slower within 3 % (run-to-run noise of one call on a busy VM)."""
_NEVER = 1 << 30


def tiled_min_batch() -> int | None:
    """The fewest rows the tiled kernel takes in this process: the build's value, ``ENVIRONMENT``'s or what
    :func:`set_tiled_min_batch` set; None where the build lacks the patch."""
    getter = _function("ggml_cpu_get_tiled_min_batch", ctypes.c_int64)
    return None if getter is None else int(getter())


def set_tiled_min_batch(rows: int) -> None:
    """Let the tiled kernel take over from ``rows`` rows, process-wide (every model: the setting is
    ggml's). Between decode calls only: every thread of a matrix product reads it."""
    setter = _function("ggml_cpu_set_tiled_min_batch", None)
    if setter is None:
        raise RuntimeError("this llama.cpp build cannot move the tiled kernel's start (no specserve patch)")
    setter(ctypes.c_int64(rows))


def _function(name: str, restype: Any) -> Callable[..., Any] | None:
    library = ggml_cpu_lib()
    function = getattr(library, name, None) if library is not None else None
    if function is not None:
        function.restype = restype
    return function


@dataclass(frozen=True)
class TiledChoice:
    """The measured start and what it was chosen from: seconds per call of each size, per kernel."""

    rows: int
    tiled_seconds: dict[int, float]
    vec_dot_seconds: dict[int, float]


def choose(tiled: dict[int, float], vec_dot: dict[int, float]) -> int:
    """The smallest candidate from which the tiled kernel is no slower (within ``TOLERANCE``) at every
    measured size; the largest candidate if it never is.

    Example: tiled / vec_dot = 1.3 at 8 rows, 0.95 at 12, 0.9 at 16 and 24: 12."""
    for start in CANDIDATES:
        if all(tiled[n] <= TOLERANCE * vec_dot[n] for n in tiled if n >= start):
            return start
    return CANDIDATES[-1]


def measure_tiled_min_batch(runtime: ModelRuntime[Any], scratch_seq: int, repeats: int = 3) -> TiledChoice:
    """Time calls of ``SIZES`` rows after a short context with the tiled kernel on and off (fastest of
    ``repeats``, the two interleaved), set the start :func:`choose` picks and return it. The scratch
    sequence is left empty."""
    vocab = min(runtime.info.vocab_size, 1000)
    context = [(7919 * i) % vocab for i in range(48)]
    probe = [(104729 * i) % vocab for i in range(max(SIZES))]
    runtime.free(scratch_seq)
    runtime.decode([DecodeChunk(scratch_seq, context, 0, 1)])
    seconds: dict[int, dict[int, float]] = {8: {}, _NEVER: {}}
    for n in SIZES:
        for _ in range(repeats):
            for start, times in seconds.items():
                set_tiled_min_batch(start)
                began = time.perf_counter()
                runtime.decode([DecodeChunk(scratch_seq, probe[:n], len(context), n)])
                runtime.synchronize()
                times[n] = min(times.get(n, float("inf")), time.perf_counter() - began)
                runtime.truncate(scratch_seq, len(context))
    runtime.free(scratch_seq)
    rows = choose(seconds[8], seconds[_NEVER])
    set_tiled_min_batch(rows)
    return TiledChoice(rows, seconds[8], seconds[_NEVER])


def user_chose() -> bool:
    """Whether the environment sets the start (then it is kept, never measured over)."""
    return bool(os.environ.get(ENVIRONMENT, "").strip())
