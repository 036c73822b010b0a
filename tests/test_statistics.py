"""The statistics CERTIFY rests on: the one-sided Clopper-Pearson bounds and the certified radius (common.py)."""
import numpy as np
import pytest
from scipy.stats import beta, binom, norm

import common


@pytest.mark.parametrize("nA,N,alpha", [(1, 10, 0.001), (55, 100, 0.01), (990, 1000, 0.001),
                                        (70_000, 100_000, 0.001), (3, 7, 0.3)])
def test_lower_bound_is_the_beta_quantile_for_interior_counts(nA, N, alpha):
    assert common.clopper_pearson_lower(nA, N, alpha) == pytest.approx(beta.ppf(alpha, nA, N - nA + 1), rel=1e-12)


@pytest.mark.parametrize("nA,N,alpha", [(1, 10, 0.001), (55, 100, 0.01), (990, 1000, 0.001), (3, 7, 0.3)])
def test_lower_bound_makes_observing_nA_or_more_exactly_alpha_likely(nA, N, alpha):
    # the defining property of the exact (Clopper-Pearson) bound, checked against the binomial tail
    p = common.clopper_pearson_lower(nA, N, alpha)
    assert binom.sf(nA - 1, N, p) == pytest.approx(alpha, rel=1e-8)


@pytest.mark.parametrize("N,alpha", [(1, 0.001), (500, 0.001), (100_000, 0.001), (1000, 0.05)])
def test_lower_bound_with_all_successes_is_alpha_to_the_one_over_N(N, alpha):
    assert common.clopper_pearson_lower(N, N, alpha) == pytest.approx(alpha ** (1 / N), rel=1e-12)


@pytest.mark.parametrize("N", [1, 100, 100_000])
def test_lower_bound_is_zero_when_nA_is_zero(N):
    assert common.clopper_pearson_lower(0, N, 0.001) == 0.0


def test_lower_bound_works_elementwise_on_arrays_including_the_edges():
    nA, N = np.array([0, 5, 10]), np.array([10, 10, 10])
    got = common.clopper_pearson_lower(nA, N, 0.01)
    assert got.shape == (3,) and got[0] == 0.0
    assert got[1] == pytest.approx(beta.ppf(0.01, 5, 6), rel=1e-12)
    assert got[2] == pytest.approx(0.01 ** (1 / 10), rel=1e-12)


@pytest.mark.parametrize("nA,N,alpha", [(0, 10, 0.001), (55, 100, 0.01), (990, 1000, 0.001)])
def test_upper_bound_is_the_beta_quantile_and_makes_nA_or_fewer_alpha_likely(nA, N, alpha):
    p = common.clopper_pearson_upper(nA, N, alpha)
    assert p == pytest.approx(beta.ppf(1 - alpha, nA + 1, N - nA), rel=1e-12)
    assert binom.cdf(nA, N, p) == pytest.approx(alpha, rel=1e-8)


def test_upper_bound_closed_forms_at_the_edges():
    assert common.clopper_pearson_upper(50, 50, 0.001) == 1.0
    assert common.clopper_pearson_upper(0, 50, 0.001) == pytest.approx(1 - 0.001 ** (1 / 50), rel=1e-12)


def test_bounds_bracket_the_point_estimate():
    for nA in (1, 30, 99):
        lower, upper = common.clopper_pearson_lower(nA, 100, 0.001), common.clopper_pearson_upper(nA, 100, 0.001)
        assert lower < nA / 100 < upper


def test_certified_radius_is_sigma_times_inverse_normal_and_zero_at_one_half():
    assert common.certified_radius(0.5, 0.25) == 0.0
    assert common.certified_radius(0.9, 0.5) == pytest.approx(0.5 * norm.ppf(0.9), rel=1e-12)
    assert common.certified_radius(norm.cdf(2.0), 1.0) == pytest.approx(2.0, rel=1e-12)


def test_the_bounds_and_radii_are_scipy_stats_bit_for_bit():
    """common.py takes Clopper-Pearson from scipy.special.betaincinv and Phi^-1 from ndtri (scipy.stats'
    import costs seconds per command): the same numbers as scipy.stats' beta.ppf and norm.ppf, exactly."""
    rng = np.random.default_rng(0)
    for N in (1, 2, 10, 100, 1000, 100_000):
        nA = np.arange(N + 1) if N <= 1000 else rng.integers(0, N + 1, 5000)
        for alpha in (1e-6, 0.001, 0.05, 0.5):
            want = np.where(nA > 0, beta.ppf(alpha, np.maximum(nA, 1), N - nA + 1), 0.0)
            assert np.array_equal(common.clopper_pearson_lower(nA, N, alpha), want)
            want = np.where(nA < N, beta.ppf(1 - alpha, nA + 1, np.maximum(N - nA, 1)), 1.0)
            assert np.array_equal(common.clopper_pearson_upper(nA, N, alpha), want)
    p = rng.random(20_000)
    assert np.array_equal(common.certified_radius(p, 0.5), 0.5 * norm.ppf(p))
