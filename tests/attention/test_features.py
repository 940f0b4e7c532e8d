"""Feature maps: exact Taylor identity, dimensions, degree rule, public bounds."""

import math

import pytest
import torch
from scipy import stats

from vllm_dp_plugin.attention.features import (
    InputBounds,
    RandomFeatures,
    TaylorFeatures,
    taylor_degree,
    taylor_dim,
    taylor_kernel_error,
)


def _taylor_exp(t: torch.Tensor, degree: int) -> torch.Tensor:
    return sum(t**j / math.factorial(j) for j in range(degree + 1))


@pytest.mark.parametrize(("dim", "degree", "beta"), [(3, 0, 0.5), (4, 1, 0.25), (5, 2, 0.2), (3, 4, 1.0)])
def test_taylor_features_reproduce_the_truncated_exp_series(dim, degree, beta):
    g = torch.Generator().manual_seed(dim * 10 + degree)
    x = torch.randn(50, dim, generator=g, dtype=torch.float64)
    y = torch.randn(50, dim, generator=g, dtype=torch.float64)
    feats = TaylorFeatures(dim, degree, beta)
    kernel = (feats(x) * feats(y)).sum(-1)
    expected = _taylor_exp(beta * (x * y).sum(-1), degree)
    assert feats.dim == math.comb(dim + degree, degree) == taylor_dim(dim, degree)
    assert torch.allclose(kernel, expected, rtol=0, atol=1e-12 * expected.abs().max())


@pytest.mark.parametrize("dim,degree", [(3, 0), (3, 1), (5, 2), (3, 3)])
def test_tensor_powers_against_expanded_rows_equal_the_monomial_contraction(dim, degree):
    """The degree <= 2 query path: [1, x, x (x) x] @ expand_rows(S) == P(x) @ S for any S."""
    features = TaylorFeatures(dim, degree, 0.6)
    g = torch.Generator().manual_seed(dim + degree)
    rows = torch.randn(2, features.dim, 4, generator=g, dtype=torch.float64)
    x = torch.randn(2, 6, dim, generator=g, dtype=torch.float64)
    expanded = features.expand_rows(rows)
    assert expanded.shape == (2, sum(dim**j for j in range(degree + 1)), 4)
    torch.testing.assert_close(torch.bmm(features.tensor_powers(x), expanded), torch.bmm(features(x), rows))


def test_lemma_g5_relative_error_holds_on_a_grid_including_corners():
    dim, bound = 2, 1.0
    degree = taylor_degree(1.0 / dim * dim * bound**2, 0.1, signed=False)
    feats = TaylorFeatures(dim, degree, 1.0 / dim)
    axis = torch.linspace(0, bound, 6, dtype=torch.float64)
    grid = torch.cartesian_prod(axis, axis)
    approx = feats(grid) @ feats(grid).T
    exact = torch.exp(grid @ grid.T / dim)
    assert ((approx - exact).abs() <= 0.1 * torch.minimum(approx, exact) + 1e-15).all()


def test_degree_rule_is_the_smallest_meeting_the_poisson_tail():
    for t in (0.25, 1.0, 2.25, 4.0):
        s = taylor_degree(t, 0.1, signed=False)
        target = 0.1 / 1.1
        assert stats.poisson.sf(s, t) <= target
        assert s == 0 or stats.poisson.sf(s - 1, t) > target
    assert taylor_degree(1.0, 0.1, signed=False) == 2  # R = 1: T = beta d R^2 = 1
    assert taylor_degree(2.25, 0.1, signed=False) == 4  # R = 1.5
    assert taylor_degree(1.0, 0.1, signed=True) % 2 == 0


def test_kernel_error_of_the_rule_degree_is_within_target():
    for signed in (False, True):
        s = taylor_degree(1.5, 0.05, signed)
        assert taylor_kernel_error(1.5, s, signed) <= 0.05 + 1e-12


def test_taylor_bounds_hold_for_every_input_within_them():
    dim, feats = 3, TaylorFeatures(3, 2, 1 / 3)
    bounds = InputBounds.of(1.5, None, dim)
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(2000, dim, generator=g, dtype=torch.float64) * 2 - 1) * 1.5
    corners = torch.cartesian_prod(*[torch.tensor([-1.5, 1.5], dtype=torch.float64)] * dim)
    x = torch.cat([x, corners])
    p = feats(x)
    assert (p.abs() <= feats.coordinate_bounds(bounds) * (1 + 1e-12)).all()
    assert p.norm(dim=-1).max() <= feats.norm_bound(bounds) * (1 + 1e-12)
    assert math.isclose(p.norm(dim=-1).max(), feats.norm_bound(bounds), rel_tol=1e-12)  # tight


def test_paper_global_bound_dominates_every_coordinate_range_for_beta_one_over_d():
    dim = 4
    feats = TaylorFeatures(dim, 3, 1 / dim)
    bounds = InputBounds.of(1.2, None, dim)
    assert feats.coordinate_bounds(bounds).max() <= feats.paper_global_bound(1.2)


def test_random_features_are_unbiased_positive_and_bounded():
    dim, beta = 4, 0.5
    feats = RandomFeatures(dim, 20000, beta, seed=3)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(5, dim, generator=g, dtype=torch.float64) * 0.5
    approx = feats(x) @ feats(x).T
    exact = torch.exp(beta * x @ x.T)
    assert (feats(x) > 0).all()
    assert torch.allclose(approx, exact, rtol=0.05)
    bounds = InputBounds.of(0.5, None, dim)
    assert (feats(x) <= feats.coordinate_bounds(bounds) * (1 + 1e-12)).all()
    assert torch.equal(RandomFeatures(dim, 8, beta, seed=3).omega, RandomFeatures(dim, 8, beta, seed=3).omega)


def test_bad_feature_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="beta"):
        TaylorFeatures(3, 2, 0.0)
    with pytest.raises(ValueError, match="degree"):
        TaylorFeatures(3, -1, 1.0)
    with pytest.raises(ValueError, match="coordinates"):
        TaylorFeatures(128, 6, 1.0)
    with pytest.raises(ValueError, match="logit bound"):
        taylor_degree(float("nan"), 0.1, False)
