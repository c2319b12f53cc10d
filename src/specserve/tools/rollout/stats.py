"""Two-sample tests for ``specserve verify``: do two samples of outcomes come from the same distribution?

Outcomes are categories (a token id at one position, or a short output text). A chi-square test of
homogeneity on the 2 × m contingency table answers it; categories seen fewer than ``min_count`` times in
both samples together are pooled into one "other" column, so that the chi-square approximation holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np

MIN_COUNT = 5


def chi_square_p_value(
    sample_a: Sequence[Hashable], sample_b: Sequence[Hashable], min_count: int = MIN_COUNT
) -> tuple[float, int]:
    """(p-value, number of columns tested); p = 1 when fewer than two columns remain after pooling."""
    from scipy.stats import chi2_contingency

    counts_a, counts_b = Counter(sample_a), Counter(sample_b)
    categories = sorted(set(counts_a) | set(counts_b), key=repr)
    kept = [c for c in categories if counts_a[c] + counts_b[c] >= min_count]
    columns = [[counts_a[c] for c in kept], [counts_b[c] for c in kept]]
    rare = [sum(counts_a.values()) - sum(columns[0]), sum(counts_b.values()) - sum(columns[1])]
    if sum(rare):
        columns[0].append(rare[0])
        columns[1].append(rare[1])
    if len(columns[0]) < 2 or not sample_a or not sample_b:
        return 1.0, len(columns[0])
    result = chi2_contingency(np.array(columns, dtype=np.int64))
    return float(result.pvalue), len(columns[0])


def bonferroni(p_values: Sequence[float]) -> float:
    """The family-wise p-value of many tests: the smallest one times their number (at most 1)."""
    return min(1.0, min(p_values) * len(p_values)) if p_values else 1.0
