"""Measured cost of a decode call as a function of the number of tokens in the batch.

On a GPU a verify pass over k+1 positions costs about one decode step; on this project's CPU it costs
nearly k+1 steps. The engine therefore measures instead of assuming: at load it times decode calls of
several sizes on a scratch sequence (``calibrate``), and afterwards every real decode refines the table
(``observe``, an exponential moving average that a size shares with its neighbours). The length policy
reads ``seconds(n)``.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from specserve.backends.base import DecodeChunk, ModelRuntime

CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CALIBRATION_METHOD = "sizes-in-turn-5"
"""Part of a cached table's key: a table measured another way is measured again, not reused for a day."""
CALIBRATION_BUDGET_S = 45.0
"""Seconds ``calibrate``'s rounds may take in all; beyond it (as the first rounds project) it keeps
``MIN_CALIBRATION_ROUNDS``."""
MIN_CALIBRATION_ROUNDS = 2
PROBE_SIZES = (1, 8)
PROBE_TOLERANCE = 2.0
SHAPE_TOLERANCE = 1.2
SHARED_OCTAVES = 2.0
"""How far one observed verify size moves the sizes around it, in doublings of the rows: fully at its own
size, linearly less out to a quarter and to four times it (``StepCostTable.observe``)."""
log = logging.getLogger("specserve.cost_model")


@dataclass
class StepCostTable:
    """Seconds per decode call of ``n`` tokens, for n = 1 .. max_tokens (interpolated between samples)."""

    seconds: np.ndarray  # [max_tokens + 1] float64; index 0 unused
    ema: float = 0.05
    observations: int = 0

    @classmethod
    def from_samples(cls, samples: dict[int, float], max_tokens: int = 64) -> StepCostTable:
        sizes = np.array(sorted(samples), dtype=np.float64)
        times = np.array([samples[int(s)] for s in sizes], dtype=np.float64)
        grid = np.arange(max_tokens + 1, dtype=np.float64)
        table = np.interp(grid, sizes, times)
        if sizes.size >= 2 and max_tokens > sizes[-1]:
            # Beyond the last sample, grow linearly with the last measured slope.
            slope = max((times[-1] - times[-2]) / (sizes[-1] - sizes[-2]), 0.0)
            beyond = grid > sizes[-1]
            table[beyond] = times[-1] + slope * (grid[beyond] - sizes[-1])
        table[0] = 0.0
        return cls(table)

    def __call__(self, n_tokens: int) -> float:
        if n_tokens <= 0:
            return 0.0
        if n_tokens < self.seconds.size:
            return float(self.seconds[n_tokens])
        per_token = self.seconds[-1] / (self.seconds.size - 1)
        return float(per_token * n_tokens)

    def observe(self, n_tokens: int, seconds: float) -> None:
        """Fold one measured decode into the table (outliers beyond 3x are ignored: a preempted thread).

        A one-token step moves the level of the whole curve, not its own point only: plain steps are
        observed all the time and verify sizes rarely, and what moves a one-token step (the KV depth, the
        machine's speed) moves every size alike. A table calibrated at an empty context whose one-token
        cost alone followed decoding to its depth priced an extra verify row at 0.34 of a step where it
        cost 0.84 (AVX2, Zen 5), and a fresh process drafted at acceptance that could not pay.

        A verify size moves its neighbours too (``SHARED_OCTAVES``), by the same ratio, less with distance:
        one size of 17–32 rows is seen a few times in a run, and on its own the average barely moved. At
        concurrency 4 on the agent traces (AMD EPYC Zen 5) one-pass steps of 17–32 rows then ran 1.13–1.14x
        their price and 9–16 rows 1.05–1.07x, while 1–4 rows (seen thousands of times) were within 0.3 %: an
        agent's long verifies at depth cost more than the table measured near an empty context, at every
        size alike, and the policy drafted as if they did not. Small sizes (2–4 rows: the plain steps of a
        few sequences) move with nearby verifies too, and are observed often enough to correct themselves;
        the last entry, which prices every pass beyond the table (long prompt chunks too), moves with
        observations of 16–63 rows."""
        if not 0 < n_tokens < self.seconds.size:
            return
        current = self.seconds[n_tokens]
        if current > 0 and not (current / 3 < seconds < current * 3):
            return
        updated = (1 - self.ema) * current + self.ema * seconds
        if current <= 0:
            self.seconds[n_tokens] = updated
        elif n_tokens == 1:
            self.seconds *= updated / current
        else:
            distance = np.abs(_octaves(self.seconds.size) - math.log2(n_tokens))
            self.seconds[2:] *= (updated / current) ** np.maximum(1 - distance / SHARED_OCTAVES, 0.0)
        self.observations += 1


@functools.cache
def _octaves(size: int) -> npt.NDArray[np.float64]:
    """log2 of the verify sizes 2 .. size - 1 of a table with ``size`` entries (read-only)."""
    octaves = np.log2(np.arange(2, size, dtype=np.float64))
    octaves.flags.writeable = False
    return octaves


@dataclass
class CostModel:
    """Decode costs of the target and, when loaded, the draft model."""

    target: StepCostTable
    draft: StepCostTable | None = None

    def as_dict(self) -> dict[str, object]:
        def table(t: StepCostTable | None) -> dict[int, float] | None:
            if t is None:
                return None
            return {n: round(t(n) * 1000, 3) for n in CALIBRATION_SIZES if n < t.seconds.size}

        return {"target_ms": table(self.target), "draft_ms": table(self.draft)}


def calibrate(
    runtime: ModelRuntime[Any],
    scratch_seq: int,
    sizes: tuple[int, ...] = CALIBRATION_SIZES,
    repeats: int = 5,
    context_tokens: int = 48,
    max_tokens: int = 64,
    budget_s: float = CALIBRATION_BUDGET_S,
) -> StepCostTable:
    """Time decode calls of each size after a short context on ``scratch_seq``; fastest of ``repeats``
    rounds, or of two where the rounds so far say all of them would take longer than ``budget_s``.

    The fastest run, not the median: on a shared machine, slower runs measure other processes. The sizes
    take turns (every size once per round, ``repeats`` rounds), so that a few slow seconds on a shared
    machine slow one call of every size, not every call of one: the policy reads the curve's shape, and
    measured size after size (three calls each) one table priced 2 rows at 2.18 one-token steps where
    the kernels' own A/B measured 1.73 (AMD EPYC Zen 5), which left no draft that a fresh process's probe
    could afford.

    The budget is for runtimes whose calls are long: the torch runtime in float32 on a CPU spends 15 s a
    round on the default target (a one-token call 0.9 s, AMD Zen 3), where noise of a few milliseconds is
    small beside each call, and two rounds still drop one slow call of each size. llama.cpp's tables on a
    CPU stay within it (the default target with one thread on Zen 3: 28 s for five rounds).

    The scratch sequence is left empty afterwards.
    """
    vocab = runtime.info.vocab_size
    # A small context (--ctx-size 32) must still leave room for the timed calls after the context.
    context_tokens = max(1, min(context_tokens, runtime.info.context_per_sequence // 2))
    rng = np.random.default_rng(0)
    context = [int(t) for t in rng.integers(0, min(vocab, 1000), context_tokens)]
    limit = runtime.info.context_per_sequence - context_tokens
    runtime.free(scratch_seq)
    runtime.decode([DecodeChunk(scratch_seq, context, 0, 1)])
    # One untimed call first: the first decode of a new shape pays one-off allocation.
    runtime.decode([DecodeChunk(scratch_seq, context[:1], context_tokens, 1)])
    runtime.truncate(scratch_seq, context_tokens)
    fitting = [n for n in sizes if n <= limit]
    samples = {n: float("inf") for n in fitting}
    began = time.perf_counter()
    for done in range(repeats):
        if done >= MIN_CALIBRATION_ROUNDS and (time.perf_counter() - began) / done * repeats > budget_s:
            break
        for n in fitting:
            tokens = context[:n] if n <= len(context) else (context * (n // len(context) + 1))[:n]
            start = time.perf_counter()
            runtime.decode([DecodeChunk(scratch_seq, tokens, context_tokens, n)])
            runtime.synchronize()
            samples[n] = min(samples[n], time.perf_counter() - start)
            runtime.truncate(scratch_seq, context_tokens)
    runtime.free(scratch_seq)
    return StepCostTable.from_samples(samples, max_tokens=max_tokens)


def probe(runtime: ModelRuntime[Any], scratch_seq: int) -> dict[int, float]:
    """Seconds of decode calls of ``PROBE_SIZES`` rows, measured as ``calibrate`` measures them (fastest of
    three; the scratch sequence is left empty)."""
    table = calibrate(runtime, scratch_seq, sizes=PROBE_SIZES, repeats=3)
    return {n: table(n) for n in PROBE_SIZES}


def probe_disagreement(cached: StepCostTable, probed: dict[int, float]) -> str | None:
    """Why a cached table does not describe the runtime a probe just timed, or None if it does.

    Two checks: the one-token cost within ``PROBE_TOLERANCE`` (a table measured while other processes held
    the cores), and the shape, the cost of ``PROBE_SIZES[-1]`` rows in one-token steps, within
    ``SHAPE_TOLERANCE`` (a table of another build of the same model and settings: the kernels behind verify
    rows changed, e.g. the tiled kernel's start, and a first request would be priced by the old curve)."""
    one, rows = PROBE_SIZES[0], PROBE_SIZES[-1]
    if not 1 / PROBE_TOLERANCE <= probed[one] / cached(one) <= PROBE_TOLERANCE:
        return f"one token: {cached(one) * 1000:.1f} ms cached, {probed[one] * 1000:.1f} ms now"
    steps_cached, steps_now = cached(rows) / cached(one), probed[rows] / probed[one]
    if not 1 / SHAPE_TOLERANCE <= steps_now / steps_cached <= SHAPE_TOLERANCE:
        return f"{rows} rows: {steps_cached:.2f} one-token steps cached, {steps_now:.2f} now"
    return None


def rescaled(cached: StepCostTable, probed: dict[int, float]) -> StepCostTable:
    """The cached curve at the level the probe just measured: its one-token cost becomes the probe's.

    The probe accepts a table whose one-token cost is within ``PROBE_TOLERANCE`` of this moment's, so a
    table measured on a faster or slower day would otherwise price this process's steps by that day. The
    policy's choices depend only on the curve's shape (every cost scales alike), but the speculation budget
    books measured passes against the table's price of the plain steps they replaced: a table 20 % too
    slow hides a fifth of every loss from it, exactly on the first requests of a fresh process."""
    one = PROBE_SIZES[0]
    return StepCostTable(cached.seconds * (probed[one] / cached(one)), ema=cached.ema)


def cached_calibration(
    runtime: ModelRuntime[Any],
    scratch_seq: int,
    cache_dir: Path | None,
    key_parts: Mapping[str, object],
    tune_kernels: bool = False,
) -> StepCostTable:
    """``calibrate`` once per (model file, threads, mode) and reuse it for a day: the CLI starts faster, and
    the online refinement corrects any drift. ``cache_dir=None`` always measures.

    A cached table is reused only if a probe of one and eight rows agrees with it (``probe_disagreement``):
    a table measured while other processes held the cores, or with another build's kernels, would otherwise
    mislead the policy for a day, on the first requests of every fresh process above all: the online
    refinement is slow, and it ignores observations more than 3x off its table. A table the probe agrees
    with is scaled to the probe's one-token cost (``rescaled``): its shape is kept, its level is now's.

    ``tune_kernels`` (the target only: the settings are process-wide) first measures the runtime's kernel
    settings (``ModelRuntime.tune_kernels``), which the costs depend on; they are cached with the table and
    restored before the probe."""
    if cache_dir is None:
        if tune_kernels:
            runtime.tune_kernels(scratch_seq)
        return calibrate(runtime, scratch_seq)
    path = Path(runtime.info.path)
    stat = path.stat()
    key = json.dumps(
        {
            "file": str(path.resolve()),
            "size": stat.st_size,
            "mtime": stat.st_mtime,
            "method": CALIBRATION_METHOD,
            **key_parts,
        },
        sort_keys=True,
        default=str,
    )
    file = cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    # Engines starting together on one machine (Ray Serve replicas) take turns: measured side by side,
    # each would see the other's load and both would distort the table; the second then reuses the first's.
    with _exclusive(file.with_suffix(".lock")):
        return _cached_or_measured(runtime, scratch_seq, file, key, tune_kernels)


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An advisory lock between processes (none if the cache directory cannot hold the lock file)."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        handle = lock_path.open("a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _cached_or_measured(
    runtime: ModelRuntime[Any], scratch_seq: int, file: Path, key: str, tune_kernels: bool
) -> StepCostTable:
    try:
        data = json.loads(file.read_text())
        if time.time() - data["created"] < 86400:
            if tune_kernels:
                runtime.restore_kernels(data["kernels"])  # a table cached without them is measured again
            cached = StepCostTable(np.array(data["seconds"], dtype=np.float64))
            probed = probe(runtime, scratch_seq)
            disagreement = probe_disagreement(cached, probed)
            if disagreement is None:
                return rescaled(cached, probed)
            log.info("cached calibration disagrees with a probe (%s): re-measuring", disagreement)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        pass
    kernels = runtime.tune_kernels(scratch_seq) if tune_kernels else {}
    table = calibrate(runtime, scratch_seq)
    record = {"key": key, "created": time.time(), "seconds": table.seconds.tolist(), "kernels": kernels}
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(record))
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return table
