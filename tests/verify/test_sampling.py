"""Logits → probabilities and inverse-CDF sampling: exact hand-built cases, random checks vs the oracle."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from specserve.request import SamplingParams
from specserve.verify import filter_logits_to_probs, greedy_argmax, probs_from_params, sample_inverse_cdf

from .reference import filter_logits_to_probs_ref, inverse_cdf_ref

PROBS = [0.1, 0.4, 0.2, 0.3]  # ranks: token 1, 3, 2, 0


def logits_of(*rows: list[float], dtype: type = np.float32) -> np.ndarray:
    """Logits whose softmax at temperature 1 is each given row (up to float rounding)."""
    with np.errstate(divide="ignore"):
        return np.log(np.array(rows, dtype=np.float64)).astype(dtype)


def assert_probs(actual: np.ndarray, expected: Sequence[float] | Sequence[Sequence[float]]) -> None:
    assert actual.dtype == np.float64
    np.testing.assert_allclose(actual, np.array(expected, ndmin=2), rtol=1e-6, atol=1e-12)
    assert np.all((actual == 0) == (np.array(expected, ndmin=2) == 0)), "filtered tokens must be exactly zero"


# --- temperature and softmax ------------------------------------------------------------------------------


def test_temperature_one_is_plain_softmax() -> None:
    logits = np.array([[0.0, math.log(2), math.log(4)]], dtype=np.float32)
    assert_probs(filter_logits_to_probs(logits, 1.0), [1 / 7, 2 / 7, 4 / 7])


@pytest.mark.parametrize(
    ("temperature", "expected"),
    [(0.5, [1 / 21, 4 / 21, 16 / 21]), (2.0, [1 / (3 + 2**0.5), 2**0.5 / (3 + 2**0.5), 2 / (3 + 2**0.5)])],
)
def test_temperature_divides_logits(temperature: float, expected: list[float]) -> None:
    logits = np.array([[0.0, math.log(2), math.log(4)]], dtype=np.float32)
    assert_probs(filter_logits_to_probs(logits, temperature), expected)


def test_large_logits_do_not_overflow_and_banned_tokens_get_zero() -> None:
    logits = np.array([[1000.0, 1000.0, -np.inf, 999.0]], dtype=np.float32)
    e = math.exp(-1)
    assert_probs(filter_logits_to_probs(logits, 1.0), [1 / (2 + e), 1 / (2 + e), 0.0, e / (2 + e)])


# --- top-k, top-p, min-p ----------------------------------------------------------------------------------


def test_top_k_keeps_the_k_most_probable() -> None:
    assert_probs(filter_logits_to_probs(logits_of(PROBS), 1.0, top_k=2), [0, 4 / 7, 0, 3 / 7])
    assert_probs(filter_logits_to_probs(logits_of(PROBS), 1.0, top_k=1), [0, 1, 0, 0])


def test_top_k_ties_at_the_boundary_keep_exactly_k_lowest_ids() -> None:
    logits = np.array([[1.0, 2.0, 2.0, 2.0, 0.0], [2.0, 0.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    out = filter_logits_to_probs(logits, 1.0, top_k=2)
    assert_probs(out, [[0, 0.5, 0.5, 0, 0], [0.5, 0, 0.5, 0, 0]])


def test_top_k_beyond_the_allowed_tokens_keeps_them_all() -> None:
    logits = np.array([[0.0, -np.inf, -np.inf, 0.0]], dtype=np.float32)
    assert_probs(filter_logits_to_probs(logits, 1.0, top_k=3), [0.5, 0, 0, 0.5])


@pytest.mark.parametrize("top_k", [0, 4, 100])
def test_top_k_zero_or_at_least_vocab_is_disabled(top_k: int) -> None:
    assert_probs(filter_logits_to_probs(logits_of(PROBS), 1.0, top_k=top_k), PROBS)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.01, [0, 1, 0, 0]),  # the top token always stays
        (0.39, [0, 1, 0, 0]),
        (0.6, [0, 4 / 7, 0, 3 / 7]),
        (0.71, [0, 4 / 9, 2 / 9, 3 / 9]),
        (0.95, PROBS),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_top_p(top_p: float, expected: list[float]) -> None:
    assert_probs(filter_logits_to_probs(logits_of(PROBS), 1.0, top_p=top_p), expected)


def test_top_p_mass_landing_exactly_on_top_p_stops_there() -> None:
    # 0.7 + 0.2 is 0.8999999999999999 in floating point: it must still count as reaching 0.9.
    logits = logits_of([0.1, 0.2, 0.7], dtype=np.float64)
    assert_probs(filter_logits_to_probs(logits, 1.0, top_p=0.9), [0, 2 / 9, 7 / 9])
    uniform = np.zeros((1, 4), dtype=np.float32)  # exactly 0.25 each
    assert_probs(filter_logits_to_probs(uniform, 1.0, top_p=0.5), [0.5, 0.5, 0, 0])  # ties: lowest ids
    assert_probs(filter_logits_to_probs(uniform, 1.0, top_p=0.5001), [1 / 3, 1 / 3, 1 / 3, 0])


def test_top_p_is_measured_on_the_mass_top_k_kept() -> None:
    # top-k 3 keeps 0.9 of the mass; 0.4 + 0.3 = 0.78 of it reaches 0.75 (of the full mass it would not).
    assert_probs(filter_logits_to_probs(logits_of(PROBS), 1.0, top_k=3, top_p=0.75), [0, 4 / 7, 0, 3 / 7])
    assert_probs(filter_logits_to_probs(logits_of(PROBS), 1.0, top_p=0.75), [0, 4 / 9, 2 / 9, 3 / 9])


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.3, [0, 4 / 9, 2 / 9, 3 / 9]), (0.6, [0, 4 / 7, 0, 3 / 7]), (1.0, [0, 1, 0, 0])],
)
def test_min_p_drops_tokens_below_min_p_times_the_top(min_p: float, expected: list[float]) -> None:
    assert_probs(filter_logits_to_probs(logits_of(PROBS), 1.0, min_p=min_p), expected)


def test_all_filters_in_order() -> None:
    probs = [0.05, 0.3, 0.25, 0.2, 0.12, 0.08]
    # top-k 4 keeps {1, 2, 3, 4} (mass 0.87); top-p 0.8 needs 0.696 of it: 0.3 + 0.25 + 0.2 -> {1, 2, 3};
    # min-p 0.7 drops what is below 0.21 -> {1, 2}.
    out = filter_logits_to_probs(logits_of(probs), 1.0, top_k=4, top_p=0.8, min_p=0.7)
    assert_probs(out, [0, 0.3 / 0.55, 0.25 / 0.55, 0, 0, 0])
    # Temperature acts first: at T = 0.5 the probabilities are proportional to the squares.
    squares = [p * p for p in probs]
    total = sum(squares)
    sharp = [s / total for s in squares]  # 0.049, 0.392, 0.272, 0.174, 0.063, 0.028 (rounded)
    out = filter_logits_to_probs(logits_of(probs), 0.5, top_k=3, top_p=0.5)
    kept = sharp[1] + sharp[2]  # top-3 mass 0.838; 0.5 of it is reached by tokens 1 and 2
    assert_probs(out, [0, sharp[1] / kept, sharp[2] / kept, 0, 0, 0])


def test_each_row_is_filtered_on_its_own() -> None:
    logits = logits_of(PROBS, [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25])
    out = filter_logits_to_probs(logits, 1.0, top_k=3, top_p=0.6)
    assert_probs(out, [[0, 4 / 7, 0, 3 / 7], [4 / 7, 3 / 7, 0, 0], [0.5, 0.5, 0, 0]])


def test_invalid_arguments_raise() -> None:
    with pytest.raises(ValueError, match="temperature"):
        filter_logits_to_probs(logits_of(PROBS), 0.0)
    with pytest.raises(ValueError, match="vocab"):
        filter_logits_to_probs(np.zeros(4, dtype=np.float32), 1.0)


def test_probs_from_params_applies_the_request_parameters() -> None:
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.75, min_p=0.1)
    assert_probs(probs_from_params(logits_of(PROBS), params), [0, 4 / 7, 0, 3 / 7])
    with pytest.raises(ValueError, match="greedy"):
        probs_from_params(logits_of(PROBS), SamplingParams(temperature=0.0))


# --- sampling ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("u", "token"),
    [
        (0.0, 0),
        (np.nextafter(0.25, 0.0), 0),
        (0.25, 1),
        (np.nextafter(0.5, 0.0), 1),
        (0.5, 2),
        (np.nextafter(1.0, 0.0), 2),
    ],
)
def test_inverse_cdf_boundaries(u: float, token: int) -> None:
    probs = np.array([[0.25, 0.25, 0.5], [1.0, 1.0, 2.0]])  # the second row is unnormalized
    assert sample_inverse_cdf(probs, np.array([u, u])).tolist() == [token, token]


@pytest.mark.parametrize(
    ("u", "token"), [(0.0, 1), (np.nextafter(0.5, 0.0), 1), (0.5, 3), (np.nextafter(1.0, 0.0), 3), (1.0, 3)]
)
def test_inverse_cdf_skips_zero_probability_tokens(u: float, token: int) -> None:
    # u = 1.0 is outside the contract; it shows the guard returning the last nonzero token, not token 4.
    probs = np.array([[0.0, 0.5, 0.0, 0.5, 0.0]])
    result = sample_inverse_cdf(probs, np.array([u]))
    assert result.dtype == np.int64
    assert result.tolist() == [token]


def test_inverse_cdf_never_returns_a_zero_probability_token() -> None:
    rng = np.random.default_rng(7)
    probs = rng.random((2000, 16)) * (rng.random((2000, 16)) < 0.3)
    probs[:, 5] += 1e-3  # at least one positive entry per row
    probs /= probs.sum(axis=1, keepdims=True)
    edges = np.array([0.0, np.nextafter(1.0, 0.0), 0.5])
    uniforms = np.concatenate([rng.random(2000 - edges.size), edges])
    tokens = sample_inverse_cdf(probs, uniforms)
    assert np.all(probs[np.arange(2000), tokens] > 0)


def test_inverse_cdf_rejects_rows_without_mass() -> None:
    with pytest.raises(ValueError, match="positive sum"):
        sample_inverse_cdf(np.zeros((1, 3)), np.array([0.5]))


def test_greedy_argmax_ties_go_to_the_lowest_id() -> None:
    logits = np.array([[[0.0, 3.0, 3.0], [5.0, 5.0, 1.0]]], dtype=np.float32)
    result = greedy_argmax(logits)
    assert result.dtype == np.int64
    assert result.tolist() == [[1, 0]]


# --- random cross-checks against the oracle ---------------------------------------------------------------

FILTER_SETTINGS = [
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.8, 0.0),
    (0.9, 0, 1.0, 0.1),
    (0.8, 12, 0.9, 0.05),
    (1.0, 3, 0.5, 0.5),
]


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), FILTER_SETTINGS)
def test_filter_matches_the_oracle(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    rng = np.random.default_rng(11)
    for vocab in (7, 50, 300):
        logits = (rng.standard_normal((6, vocab)) * 2).astype(np.float32)
        logits[:3] = np.round(logits[:3] * 2) / 2  # many exact ties
        logits[0, : vocab // 3] = -np.inf
        expected = filter_logits_to_probs_ref(logits, temperature, top_k, top_p, min_p)
        actual = filter_logits_to_probs(logits, temperature, top_k, top_p, min_p)
        np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-15)
        np.testing.assert_array_equal(actual == 0, expected == 0)
        np.testing.assert_allclose(actual.sum(axis=1), 1.0, rtol=1e-12)


def test_filter_matches_the_oracle_at_full_vocabulary_size() -> None:
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((2, 151936)) * 3).astype(np.float32)
    for top_k, top_p, min_p in [(50, 0.9, 0.0), (0, 0.95, 0.01)]:
        expected = filter_logits_to_probs_ref(logits, 0.8, top_k, top_p, min_p)
        actual = filter_logits_to_probs(logits, 0.8, top_k, top_p, min_p)
        np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-15)
        np.testing.assert_array_equal(actual == 0, expected == 0)


def test_inverse_cdf_matches_the_oracle() -> None:
    rng = np.random.default_rng(3)
    probs = rng.random((500, 9)) ** 3 * (rng.random((500, 9)) < 0.6)
    probs[:, 0] += 1e-9
    probs /= probs.sum(axis=1, keepdims=True)
    uniforms = rng.random(500)
    expected = [inverse_cdf_ref(row.tolist(), float(u)) for row, u in zip(probs, uniforms, strict=True)]
    assert sample_inverse_cdf(probs, uniforms).tolist() == expected


def test_a_denormal_temperature_is_near_greedy_not_nan_regression_engine_crash() -> None:
    # Found by schema fuzzing: temperature 5e-324 with top_k 3 made every probability NaN and the engine
    # thread died. Dividing the max-shifted logits keeps the maximum at 0 and sends the rest to -inf.
    logits = np.array([[1.0, 2.0, 2.0, -np.inf, 0.5]], dtype=np.float32)
    for top_k, top_p in ((3, 5e-324), (0, 1.0)):
        probs = filter_logits_to_probs(logits, 5e-324, top_k, top_p)
        assert np.all(np.isfinite(probs)) and probs.sum() == pytest.approx(1.0)
        assert probs[0, 0] == probs[0, 3] == probs[0, 4] == 0.0  # only the tied maxima can be drawn


def test_the_argmax_of_many_rows_split_over_two_threads_is_each_rows_own() -> None:
    """From PARALLEL_ARGMAX_ROWS rows the argmax runs in two halves: the same ids, ties to the lowest."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((33, 1000)).astype(np.float32)
    logits[3, [10, 700]] = 50.0  # a tie in the first half
    logits[30, [5, 6]] = 50.0  # and in the second
    chosen = greedy_argmax(logits)
    assert chosen.dtype == np.int64 and chosen.tolist() == [int(np.argmax(row)) for row in logits]
    assert chosen[3] == 10 and chosen[30] == 5
