"""The rollout checks' pure parts: the two-sample test, the first difference, expected speed-ups."""

from __future__ import annotations

import random

import pytest

from specserve.engine.cost_model import CostModel, StepCostTable
from specserve.tools.rollout.consistency import first_difference
from specserve.tools.rollout.evaluate import Tally
from specserve.tools.rollout.stats import bonferroni, chi_square_p_value


def test_chi_square_tells_same_from_different_distributions() -> None:
    rng = random.Random(0)
    a = rng.choices("abc", weights=[5, 3, 2], k=400)
    b = rng.choices("abc", weights=[5, 3, 2], k=400)
    c = rng.choices("abc", weights=[2, 3, 5], k=400)
    assert chi_square_p_value(a, b)[0] > 0.01
    p, columns = chi_square_p_value(a, c)
    assert p < 1e-6 and columns == 3
    assert chi_square_p_value(["a"] * 10, ["a"] * 10) == (1.0, 1)  # one outcome: nothing to test
    assert chi_square_p_value(list("abcdefgh"), list("ijklmnop"))[1] == 1  # all rare: pooled into "other"
    assert bonferroni([0.2, 0.004]) == pytest.approx(0.008)
    assert bonferroni([]) == 1.0


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference("abc", "ab") == 2


def test_expected_speedup_from_the_cost_model() -> None:
    """target(n) = n ms for n ≤ 2, then flat: a 2-token verify costs 2 ms, 5 tokens 2 ms too."""
    costs = CostModel(StepCostTable.from_samples({1: 1.0, 2: 2.0, 8: 2.0}))
    tally = Tally(decode_tokens=10)
    tally.steps = [("ngram", 4, 4), ("ngram", 4, 1)]  # 5 + 2 tokens; 3 more from plain steps
    assert tally.expected_seconds(costs) == pytest.approx(2.0 + 2.0 + 3 * 1.0)
    costs.draft = StepCostTable.from_samples({1: 0.5, 8: 4.0})
    tally.steps = [("draft-model", 4, 4)]  # 5 tokens, 5 plain steps; drafting costs 4 x 0.5
    assert tally.expected_seconds(costs) == pytest.approx(2.0 + 2.0 + 5 * 1.0)
