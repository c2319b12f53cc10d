"""The measured decode-cost table: interpolation, extrapolation, online refinement, and calibration."""

from __future__ import annotations

import fcntl
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from specserve.backends.base import DecodeChunk
from specserve.backends.llama_cpp import LlamaCppRuntime
from specserve.engine import cost_model
from specserve.engine.cost_model import (
    CALIBRATION_SIZES,
    CostModel,
    StepCostTable,
    cached_calibration,
    calibrate,
    probe,
    probe_disagreement,
)
from support.tiny_models import TinyModels

# -- from_samples ---------------------------------------------------------------------------------


def test_from_samples_interpolates_between_samples() -> None:
    table = StepCostTable.from_samples({1: 1.0, 3: 3.0, 5: 4.0}, max_tokens=5)
    assert table.seconds.shape == (6,)
    assert table.seconds.dtype == np.float64
    assert table.seconds.tolist() == pytest.approx([0.0, 1.0, 2.0, 3.0, 3.5, 4.0])
    assert table(0) == 0.0
    assert table(-3) == 0.0


def test_from_samples_extrapolates_linearly_with_the_last_slope() -> None:
    table = StepCostTable.from_samples({1: 1.0, 3: 3.0, 5: 4.0}, max_tokens=8)
    # Last slope (4 - 3) / (5 - 3) = 0.5 per token beyond n = 5.
    assert [table(n) for n in (5, 6, 7, 8)] == pytest.approx([4.0, 4.5, 5.0, 5.5])


def test_from_samples_never_extrapolates_downwards() -> None:
    table = StepCostTable.from_samples({1: 2.0, 2: 1.0}, max_tokens=4)
    assert [table(n) for n in (1, 2, 3, 4)] == pytest.approx([2.0, 1.0, 1.0, 1.0])


def test_from_samples_unsorted_and_single_sample() -> None:
    table = StepCostTable.from_samples({4: 4.0, 1: 1.0, 2: 2.0}, max_tokens=6)
    assert [table(n) for n in range(1, 7)] == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    flat = StepCostTable.from_samples({1: 0.5}, max_tokens=4)
    assert [flat(n) for n in range(5)] == pytest.approx([0.0, 0.5, 0.5, 0.5, 0.5])


def test_from_samples_beyond_max_tokens_interpolates_into_the_table() -> None:
    table = StepCostTable.from_samples({1: 1.0, 100: 100.0}, max_tokens=10)
    assert table.seconds.size == 11
    assert table(10) == pytest.approx(10.0)


def test_call_beyond_the_table_grows_per_token() -> None:
    table = StepCostTable.from_samples({1: 1.0, 64: 64.0}, max_tokens=64)
    assert table(64) == pytest.approx(64.0)
    assert table(128) == pytest.approx(128.0)
    assert table(65) > table(64)


# -- observe / relative ---------------------------------------------------------------------------


def test_observe_is_an_exponential_moving_average() -> None:
    table = StepCostTable.from_samples({1: 1.0, 64: 64.0})
    table.observe(1, 2.0)
    assert table(1) == pytest.approx(0.95 * 1.0 + 0.05 * 2.0)
    assert table.observations == 1
    for _ in range(300):
        table.observe(1, 2.0)
    assert table(1) == pytest.approx(2.0, rel=1e-3)
    assert table(2) == pytest.approx(4.0, rel=1e-3)  # one-token steps move the whole curve's level
    assert table.observations == 301
    table.observe(8, 20.0)  # a verify size moves its own point as an average, its neighbours less
    assert table(8) == pytest.approx(0.95 * 16.0 + 0.05 * 20.0, rel=1e-3)
    assert table(1) == pytest.approx(2.0, rel=1e-3)


def test_a_verify_size_moves_its_neighbours_less_with_distance() -> None:
    """A size seen a few times in a run (17–32 rows) learns from the sizes around it: at depth they all cost
    more than the table measured near an empty context (Zen 5, concurrency 4: 1.10x their price)."""
    table = StepCostTable.from_samples({1: 1.0, 64: 64.0})
    before = table.seconds.copy()
    table.observe(16, 20.0)  # 1.25x its price
    ratio = table.seconds / np.where(before > 0, before, 1.0)
    step = (0.95 * 16.0 + 0.05 * 20.0) / 16.0
    assert ratio[16] == pytest.approx(step)
    assert ratio[8] == pytest.approx(step**0.5) and ratio[32] == pytest.approx(step**0.5)
    assert 1.0 < ratio[24] < step and 1.0 < ratio[12] < step
    assert ratio[4] == pytest.approx(1.0) and ratio[64] == pytest.approx(1.0)  # two doublings away
    assert ratio[1] == 1.0 and ratio[2] == 1.0  # the one-token step sets the level; 2 rows are 3 octaves off
    for _ in range(200):
        table.observe(24, 30.0)  # 1.25x the table's 24 rows, again and again
    assert table(24) == pytest.approx(30.0, rel=1e-3)
    assert table(20) / before[20] == pytest.approx(table(28) / before[28], rel=0.05)
    assert table(20) / before[20] > 1.15  # learnt from 24's observations alone


def test_the_curve_keeps_its_shape_when_decoding_deepens_the_one_token_step() -> None:
    """Calibrated at an empty context (fastest of three), then decoding at depth: one-token steps cost 20 %
    more. Before, only the one-token point followed, and 2 rows looked like 1.34 steps instead of 1.6."""
    table = StepCostTable.from_samples({1: 0.0315, 2: 0.0504, 3: 0.0652, 8: 0.1745})
    for _ in range(200):
        table.observe(1, 0.0379)
    assert table(2) / table(1) == pytest.approx(1.6, rel=1e-3)
    assert table(8) / table(1) == pytest.approx(0.1745 / 0.0315, rel=1e-3)


@pytest.mark.parametrize("seconds", [3.5, 10.0, 0.3, 0.01])
def test_observe_rejects_outliers(seconds: float) -> None:
    table = StepCostTable.from_samples({1: 1.0, 64: 64.0})
    table.observe(1, seconds)
    assert table(1) == 1.0
    assert table.observations == 0


@pytest.mark.parametrize("n_tokens", [0, -1, 65, 1000])
def test_observe_ignores_sizes_outside_the_table(n_tokens: int) -> None:
    table = StepCostTable.from_samples({1: 1.0, 64: 64.0})
    before = table.seconds.copy()
    table.observe(n_tokens, 5.0)
    assert np.array_equal(table.seconds, before)
    assert table.observations == 0


def test_cost_model_as_dict_in_milliseconds() -> None:
    costs = CostModel(StepCostTable.from_samples({1: 0.001, 64: 0.064}))
    shown = costs.as_dict()
    assert shown["draft_ms"] is None
    target = shown["target_ms"]
    assert isinstance(target, dict)
    assert sorted(target) == sorted(CALIBRATION_SIZES)
    assert target[1] == pytest.approx(1.0)
    assert target[32] == pytest.approx(32.0)


# -- calibrate ------------------------------------------------------------------------------------


@pytest.fixture
def runtime(tiny_models: TinyModels) -> Iterator[LlamaCppRuntime]:
    rt = LlamaCppRuntime(tiny_models.target, n_threads=1, context_per_sequence=256, max_sequences=2)
    yield rt
    rt.close()


def test_calibrate_returns_a_positive_finite_table(runtime: LlamaCppRuntime) -> None:
    table = calibrate(runtime, scratch_seq=1, repeats=2, max_tokens=48)
    assert table.seconds.shape == (49,)
    assert table.seconds[0] == 0.0
    assert np.all(np.isfinite(table.seconds))
    assert np.all(table.seconds[1:] > 0)
    assert table(1) < 1.0  # the tiny model decodes a token in well under a second


def test_calibrate_leaves_the_scratch_sequence_empty(
    runtime: LlamaCppRuntime, tiny_models: TinyModels
) -> None:
    calibrate(runtime, scratch_seq=1, sizes=(1, 2, 4), repeats=1)
    prompt = runtime.tokenize("def f(self, x):")
    # Decoding at position 0 only works on an empty sequence, and must give a fresh runtime's logits.
    (after,) = runtime.decode([DecodeChunk(1, prompt, 0, 2)])
    after = after.copy()
    fresh = LlamaCppRuntime(tiny_models.target, n_threads=1, context_per_sequence=256, max_sequences=2)
    try:
        (expected,) = fresh.decode([DecodeChunk(1, prompt, 0, 2)])
        assert np.array_equal(after, expected)
    finally:
        fresh.close()


def test_calibrate_stops_at_sizes_the_context_cannot_hold(tiny_models: TinyModels) -> None:
    rt = LlamaCppRuntime(tiny_models.target, n_threads=1, context_per_sequence=40)
    try:
        # A 40-token context: 20 context tokens leave room for 20, so sizes 24 and 32 are skipped and the
        # table extrapolates them from the last measured slope (never below the last sample).
        table = calibrate(rt, scratch_seq=0, repeats=1)
        assert np.all(np.isfinite(table.seconds))
        assert table(32) >= table(16) > 0
        (rows,) = rt.decode([DecodeChunk(0, [1, 2, 3], 0, 1)])
        assert rows.shape == (1, rt.info.vocab_size)
    finally:
        rt.close()


# -- cached_calibration ---------------------------------------------------------------------------


def test_a_cached_table_the_probe_contradicts_is_measured_again(
    runtime: LlamaCppRuntime, tmp_path: Path
) -> None:
    """A table cached while other processes held the cores (here: 1000x too slow) is not reused."""
    first = cached_calibration(runtime, 1, tmp_path, {"threads": 1})
    (file,) = tmp_path.glob("*.json")
    data = json.loads(file.read_text())
    data["seconds"] = [s * 1000 for s in data["seconds"]]
    file.write_text(json.dumps(data))
    again = cached_calibration(runtime, 1, tmp_path, {"threads": 1})
    assert again(1) < first(1) * 100  # re-measured, not the poisoned table
    assert json.loads(file.read_text())["seconds"][1] == pytest.approx(again(1))  # and the cache mended


def test_a_cached_table_the_probe_agrees_with_is_reused(
    runtime: LlamaCppRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = cached_calibration(runtime, 1, tmp_path, {"threads": 1})
    monkeypatch.setattr(cost_model, "calibrate", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr(cost_model, "probe", lambda *a: {1: first(1) * 1.5, 8: first(8) * 1.6})
    reused = cached_calibration(runtime, 1, tmp_path, {"threads": 1})
    # The cached curve at this moment's level: a fresh process prices its plain steps by what it measured.
    assert reused.seconds == pytest.approx(first.seconds * 1.5)
    assert reused(8) / reused(1) == pytest.approx(first(8) / first(1))
    # The probe ran on the scratch sequence only: the other sequence can still start at position 0.
    (rows,) = runtime.decode([DecodeChunk(0, [1, 2], 0, 1)])
    assert rows.shape == (1, runtime.info.vocab_size)


def test_a_cached_table_of_another_cost_curve_is_measured_again(
    runtime: LlamaCppRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same one-token cost, but 8 rows now cost 4 steps where the table says 5.4 (the tiled kernel's start
    moved in a new build): a first request would be priced by the old curve."""
    first = cached_calibration(runtime, 1, tmp_path, {"threads": 1})
    measured: list[bool] = []

    def measure(*_args: object, **_kwargs: object) -> StepCostTable:
        measured.append(True)
        return first

    monkeypatch.setattr(cost_model, "calibrate", measure)
    monkeypatch.setattr(cost_model, "probe", lambda *a: {1: first(1), 8: first(8) / 1.35})
    cached_calibration(runtime, 1, tmp_path, {"threads": 1})
    assert measured == [True]


def test_tuned_kernel_settings_are_cached_with_the_table_and_restored_first(
    runtime: LlamaCppRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The costs depend on the kernels (where the tiled kernel starts): a later process restores the
    settings before its probe, and a table cached without them is measured again."""
    tuned: list[int] = []
    restored: list[dict[str, int]] = []

    def tune(seq: int) -> dict[str, int]:
        tuned.append(seq)
        return {"tiled_min_batch": 12}

    monkeypatch.setattr(runtime, "tune_kernels", tune)
    monkeypatch.setattr(runtime, "restore_kernels", lambda settings: restored.append(dict(settings)))
    first = cached_calibration(runtime, 1, tmp_path, {"threads": 1}, tune_kernels=True)
    assert (tuned, restored) == ([1], [])
    # The probe agrees with the table: on a tiny model the real probe's microseconds are noise (on a loaded
    # CI machine it disagreed and re-tuned), and what is tested here is the kernels' cache, not the probe.
    monkeypatch.setattr(cost_model, "probe", lambda *a: {1: first(1), 8: first(8)})
    cached_calibration(runtime, 1, tmp_path, {"threads": 1}, tune_kernels=True)
    assert (tuned, restored) == ([1], [{"tiled_min_batch": 12}])
    cached_calibration(runtime, 1, tmp_path, {"threads": 1})  # the draft model's: never tuned
    assert (tuned, restored) == ([1], [{"tiled_min_batch": 12}])
    (file,) = tmp_path.glob("*.json")
    data = json.loads(file.read_text())
    del data["kernels"]  # a cache written before kernels were tuned
    file.write_text(json.dumps(data))
    cached_calibration(runtime, 1, tmp_path, {"threads": 1}, tune_kernels=True)
    assert tuned == [1, 1]


@pytest.mark.parametrize(
    ("probed", "reason"),
    [
        ({1: 0.010, 8: 0.040}, None),
        ({1: 0.019, 8: 0.076}, None),  # a slower moment, the same shape
        ({1: 0.030, 8: 0.120}, "one token"),
        ({1: 0.010, 8: 0.052}, "8 rows"),
        ({1: 0.010, 8: 0.030}, "8 rows"),
    ],
)
def test_probe_disagreement(probed: dict[int, float], reason: str | None) -> None:
    cached = StepCostTable.from_samples({1: 0.010, 8: 0.040, 32: 0.140})
    found = probe_disagreement(cached, probed)
    assert found is None if reason is None else reason in str(found)


def test_probe_leaves_the_scratch_sequence_empty(runtime: LlamaCppRuntime) -> None:
    assert all(seconds > 0 for seconds in probe(runtime, 1).values())
    (rows,) = runtime.decode([DecodeChunk(1, [5], 0, 1)])
    assert rows.shape == (1, runtime.info.vocab_size)


def test_engines_starting_together_take_turns_calibrating(runtime: LlamaCppRuntime, tmp_path: Path) -> None:
    """Ray Serve replicas on one machine calibrate one after another (found by the 2 x 1-thread benchmark:
    measured side by side, both tables came out 2x slow and no replica drafted)."""
    cached_calibration(runtime, 1, tmp_path, {"threads": 1})
    (lock_path,) = tmp_path.glob("*.lock")
    done = threading.Event()

    def calibrate_then_signal() -> None:
        cached_calibration(runtime, 1, tmp_path, {"threads": 1})
        done.set()

    with lock_path.open("a") as held:  # another engine is calibrating
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=calibrate_then_signal)
        waiter.start()
        assert not done.wait(0.5)  # it waits for the other to finish
        fcntl.flock(held, fcntl.LOCK_UN)
    assert done.wait(60)
    waiter.join()


def recorded_call_rows(runtime: LlamaCppRuntime, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of each chunk ``runtime.decode`` is given from now on, in order."""
    calls: list[int] = []
    decode = runtime.decode

    def recording(chunks: list[DecodeChunk]) -> object:
        calls.extend(len(c.tokens) for c in chunks)
        return decode(chunks)

    monkeypatch.setattr(runtime, "decode", recording)
    return calls


def test_calibration_sizes_take_turns(runtime: LlamaCppRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round times every size once: a few slow seconds slow one call of each size, not all of one."""
    calls = recorded_call_rows(runtime, monkeypatch)
    calibrate(runtime, scratch_seq=1, sizes=(1, 2, 4), repeats=3, context_tokens=8)
    assert calls == [8, 1, *[1, 2, 4] * 3]  # the context, one untimed call, then three rounds


def test_calibration_keeps_two_rounds_when_all_would_pass_the_budget(
    runtime: LlamaCppRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long calls (the torch runtime in float32 on a CPU: 15 s a round) stop after two rounds; the table
    still has every size."""
    calls = recorded_call_rows(runtime, monkeypatch)
    table = calibrate(runtime, scratch_seq=1, sizes=(1, 2, 4), repeats=5, context_tokens=8, budget_s=0.0)
    assert calls == [8, 1, *[1, 2, 4] * 2]
    assert all(np.isfinite(table(n)) and table(n) > 0 for n in (1, 2, 4))
