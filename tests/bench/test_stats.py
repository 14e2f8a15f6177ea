"""Percentiles as numpy computes them, so numbers compare with other tools' reports."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.bench.stats import Distribution, percentile


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=200), st.sampled_from([0, 50, 90, 99]))
def test_percentile_matches_numpy_linear_interpolation(values, pct):
    assert np.isclose(percentile(sorted(values), pct), np.percentile(values, pct))


def test_distribution_of_no_values_is_all_zero_not_an_error():
    assert Distribution.of([]) == Distribution(0.0, 0.0, 0.0, 0.0, 0.0)


def test_distribution_summarises_mean_percentiles_and_max():
    dist = Distribution.of([4.0, 1.0, 3.0, 2.0])
    assert (dist.mean, dist.p50, dist.max) == (2.5, 2.5, 4.0)
    assert dist.summary() == "2.5 / 2.5 / 4.0 ms"
    assert dist.summary("s", with_p90=True) == "2.5 / 2.5 / 3.7 / 4.0 s"
