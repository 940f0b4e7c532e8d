"""Floating point: a float release ``f(x) + z`` is separated from its
neighbour by its low-order bits; ``GridGaussian`` (grid + exact discrete Gaussian) is not. Also
the exact integer samplers it is built on: laws against the exact pmf, rejection where plain
modulo would be biased, the CKS Bernoulli(exp(-x)) building blocks."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

from vllm_dp_plugin.privacy.noise import (
    GRID_RATIO,
    GaussianNoise,
    GridGaussian,
    LaplaceNoise,
    _bernoulli_exp,
    _bernoulli_exp_power,
    discrete_gaussian,
    uniform_below,
)

from .distinguisher import MIRONOV, events, excess, rdp_epsilon

NOISE_MULTIPLIER, DELTA = 3.0, 1e-3
N_FLOAT = 1 << 17  # the leak (~0.07) is over twice the DP slack (~0.03) at this N
N_GRID = 1 << 15  # exact sampling: ~28 draws per value
PVALUE = 1e-3


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("law", [GaussianNoise(NOISE_MULTIPLIER), LaplaceNoise(NOISE_MULTIPLIER)])
def test_float_release_is_separated_by_its_low_order_bits(law):
    """f(x) = 0 vs 1 (sensitivity 1) released as ``f(x) + z`` in float64: the ideal mechanisms
    are (epsilon, 1e-3)-DP (Gaussian: its Renyi epsilon; Laplace of scale 3: pure 1/3), but the
    set "not a multiple of 2^-53" has probability ~0.07 under 0 and exactly 0 under 1."""
    zero, one = law.sample((N_FLOAT,), gen(1)), 1.0 + law.sample((N_FLOAT,), gen(2))
    sets = events(1.0, torch.float64)
    assert not sets[MIRONOV](one).any()
    epsilon = rdp_epsilon(NOISE_MULTIPLIER, DELTA) if isinstance(law, GaussianNoise) else 1 / NOISE_MULTIPLIER
    assert excess(zero, one, sets, epsilon, DELTA)[MIRONOV] > 0


def test_grid_release_is_not_separated():
    """The same distinguisher on ``GridGaussian``: every output set within e^eps + the derived
    sampling slack (the release is gamma k, k an integer: its low bits are those of k)."""
    release = GridGaussian.calibrate(1.0, NOISE_MULTIPLIER, 1)
    zero = release.release(torch.zeros(N_GRID, dtype=torch.float64), gen(1))
    one = release.release(torch.ones(N_GRID, dtype=torch.float64), gen(2))
    found = excess(zero, one, events(1.0, torch.float64), rdp_epsilon(release.noise_multiplier, DELTA), DELTA)
    assert max(found.values()) <= 0, found


@pytest.mark.parametrize("dim", [1, 4, 1000, 10**9])
@pytest.mark.parametrize("clip,multiplier", [(1.0, 1.0), (0.7, 1.3), (1e-3, 0.5), (5.0, 8.0)])
def test_grid_calibration(clip, multiplier, dim):
    """C / gamma in [GRID_RATIO, 2 GRID_RATIO) x ceil(sqrt d) grid steps, sigma / sensitivity >= the
    multiplier (the smallest integer sigma), noise std within (1 + 2 / GRID_RATIO) of sigma C."""
    release = GridGaussian.calibrate(clip, multiplier, dim)
    root = math.ceil(math.sqrt(dim))
    steps = clip / release.grid
    assert GRID_RATIO * root <= steps < 2 * GRID_RATIO * root
    assert release.sensitivity == math.ceil(steps) + root
    assert release.sigma == math.ceil(Fraction(multiplier) * release.sensitivity)  # exact, smallest
    assert release.noise_multiplier >= multiplier
    assert 1 <= release.noise_std / (multiplier * clip) <= 1 + 2 / GRID_RATIO


def test_grid_release_is_gamma_times_an_integer_and_reproducible():
    release = GridGaussian.calibrate(1.0, 1.0, 64)
    values = torch.randn(64, generator=gen(0))
    first, again = release.release(values, gen(5)), release.release(values, gen(5))
    assert torch.equal(first, again) and first.dtype == torch.float64
    assert torch.equal(first / release.grid, torch.round(first / release.grid))
    with pytest.raises(ValueError, match="non-finite"):
        release.release(torch.tensor([0.0, float("nan")]), gen(5))


def exact_pmf(sigma: float, support: np.ndarray) -> np.ndarray:
    weights = np.exp(-(support.astype(np.float64) ** 2) / (2 * sigma**2))
    return weights / weights.sum()


@pytest.mark.parametrize("sigma", [1, 3])
def test_discrete_gaussian_matches_the_exact_pmf(sigma):
    """Chi-square against exp(-y^2 / (2 sigma^2)) / Theta (small sigma: where the lattice shows);
    the same draws reject the law of sigma * 1.05 (the test has power)."""
    draws = discrete_gaussian(sigma, (100_000,), gen(sigma)).numpy()
    support = np.arange(-12 * sigma, 12 * sigma + 1)
    observed = np.array([(draws == k).sum() for k in support])
    for scale, accept in ((sigma, True), (1.05 * sigma, False)):
        expected = exact_pmf(scale, support) * len(draws)
        keep = expected >= 5
        chi2 = (((observed - expected) ** 2 / expected)[keep]).sum() + (observed[~keep].sum() - expected[~keep].sum()) ** 2 / max(expected[~keep].sum(), 1e-300)
        assert (stats.chi2.sf(chi2, keep.sum()) > PVALUE) == accept


@pytest.mark.parametrize("sigma", [1_000_003, 1 << 40])
def test_discrete_gaussian_large_sigma_is_the_normal_law(sigma):
    """At these sigma the discrete and continuous laws differ by O(1 / sigma^2) in any CDF: KS
    against N(0, sigma^2), variance within 5 standard errors."""
    z = discrete_gaussian(sigma, (50_000,), gen(7)).double().numpy() / sigma
    assert stats.kstest(z, "norm").pvalue > PVALUE
    assert abs(z.var() - 1) <= 5 * math.sqrt(2 / len(z))


def test_discrete_gaussian_rejects_bad_sigma():
    for sigma in (0, 1.5, True, (1 << 40) + 1):
        with pytest.raises(ValueError, match="sigma"):
            discrete_gaussian(sigma, (3,), gen(0))


def test_uniform_below_is_exact_where_modulo_is_biased():
    """n = 3 * 2^60: a 62-bit draw mod n would put twice the mass on [0, 2^60); rejection makes
    the three thirds equally likely. The chi-square that accepts it rejects plain modulo."""
    n, m = 3 << 60, 30_000
    draws = uniform_below(torch.full((m,), n, dtype=torch.int64), gen(3))
    assert ((draws >= 0) & (draws < n)).all()
    plain = torch.randint(0, 1 << 62, (m,), generator=gen(3)) % n
    for values, accept in ((draws, True), (plain, False)):
        thirds = np.bincount((values // (1 << 60)).numpy(), minlength=3)
        assert (stats.chisquare(thirds).pvalue > PVALUE) == accept


@pytest.mark.parametrize("num,den,times", [(0, 1, 1), (1, 3, 1), (1, 2, 1), (1, 1, 1), (2, 3, 3)])
def test_bernoulli_exp(num, den, times):
    """Bernoulli(exp(-times num / den)) within 5 standard errors of its mean."""
    m = 100_000
    fraction = [(torch.full((m,), num), torch.full((m,), den))]
    if times == 1:
        draws = _bernoulli_exp(fraction, gen(11))
    else:
        draws = _bernoulli_exp_power(fraction, torch.full((m,), times), gen(11))
    p = math.exp(-times * num / den)
    assert abs(draws.double().mean().item() - p) <= 5 * math.sqrt(p * (1 - p) / m) + 1e-12
