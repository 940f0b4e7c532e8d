"""TrLaplace calibrations: closed-form reference values, the Thm 3 counterexample, the corrected
fix."""

import math

import pytest
import torch

from vllm_dp_plugin.privacy import (
    NotDifferentiallyPrivateWarning,
    PrivacyLedger,
    pair_delta,
    sparse_pair_delta,
    trlaplace_mechanism,
    true_delta,
)
from vllm_dp_plugin.privacy.trlaplace import REPO_CLIP_NORM, repo_effective_dim

D, C = 300, 1.0
AXIS_DIFF = torch.zeros(D, dtype=torch.float64)
AXIS_DIFF[0] = 2 * C  # x = +C e1, x' = -C e1


def paper(eps, **kw):
    with pytest.warns(NotDifferentiallyPrivateWarning, match="NOT"):
        return trlaplace_mechanism(eps, D, C, "paper", 4.0**-D, **kw)


def test_paper_parameters_match_spec_table():
    """Thm 3 in closed form at eps = 0.1, d = 300, C = 1, delta = 4^-300 (delta^(1/d) = 1/4):
    alpha = eps/(2 sqrt(d) C), p = 2 eps/sqrt(d), B = 8C."""
    mech = paper(0.1)
    alpha = 1 / mech.noise.scale
    assert alpha == pytest.approx(0.002886751346, rel=1e-9)
    assert mech.noise.truncation_mass == pytest.approx(0.01154700538, rel=1e-9)
    assert mech.noise.bound == pytest.approx(4.023273343, rel=1e-9)
    assert 2 * mech.noise.truncation_mass / alpha == pytest.approx(8.0, rel=1e-12)  # B
    assert mech.variance == pytest.approx(5.379915919, rel=1e-9)
    assert not mech.valid


def test_corrected_parameters_match_spec_table():
    mech = trlaplace_mechanism(1.0, D, C, "corrected", 1e-5)
    assert mech.noise.bound == pytest.approx(375.8135984, rel=1e-9)
    assert math.sqrt(mech.variance) == pytest.approx(48.956615, rel=1e-7)
    assert mech.valid


def test_counterexample_true_delta_of_paper_calibration():
    """The axis pair x = C e_1, x' = -C e_1 has delta = q(2C) = 0.24782797799 (coordinate 1 above
    A - C is possible under x, impossible under x'), not 4^-300."""
    mech = paper(0.1)
    assert float(pair_delta(mech, AXIS_DIFF)) == pytest.approx(0.24782797799, rel=1e-9)
    worst, k = sparse_pair_delta(mech, D, C)
    assert worst == pytest.approx(0.9866, abs=1e-4) and k == D  # x = C 1/sqrt(d), x' = -x


def _monte_carlo_delta(mech, n=200_000, chunk=20_000, seed=0):
    """Estimate P_x[T] - e^eps P_x'[T] for T = {r : r_1 > A - C}, x = C e1, x' = -C e1,
    pushing full d-dimensional draws through the mechanism. Returns (estimate, std error)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.zeros(D, dtype=torch.float64)
    x[0] = C
    threshold = mech.noise.bound - C
    hits_x = hits_xp = 0
    for _ in range(n // chunk):
        hits_x += int(((x + mech.sample((chunk, D), gen))[:, 0] > threshold).sum())
        hits_xp += int(((-x + mech.sample((chunk, D), gen))[:, 0] > threshold).sum())
    p_x, p_xp = hits_x / n, hits_xp / n
    return p_x - math.exp(mech.epsilon) * p_xp, math.sqrt(max(p_x * (1 - p_x), 1 / n) / n)


def test_counterexample_monte_carlo_agrees():
    mech = paper(0.1)
    estimate, se = _monte_carlo_delta(mech)
    assert estimate == pytest.approx(float(pair_delta(mech, AXIS_DIFF)), abs=4 * se)
    assert estimate > 0.2  # far above the claimed 4^-300


@pytest.mark.parametrize("eps", [0.1, 1.0])
def test_corrected_calibration_passes_the_same_check(eps):
    """Axis, spread and every k-sparse pair stay <= delta; MC finds nothing."""
    delta = 1e-5
    mech = trlaplace_mechanism(eps, D, C, "corrected", delta)
    assert float(pair_delta(mech, AXIS_DIFF)) <= delta
    worst, _ = sparse_pair_delta(mech, D, C)
    assert worst <= delta
    assert worst > 0.9 * delta  # the calibration is tight, not just loose
    estimate, se = _monte_carlo_delta(mech)
    assert estimate <= delta + 4 * se


def test_true_delta_over_a_finite_domain():
    mech = paper(0.1)
    points = torch.stack([AXIS_DIFF / 2, -AXIS_DIFF / 2, torch.zeros(D, dtype=torch.float64)])
    assert true_delta(mech, points) == pytest.approx(float(pair_delta(mech, AXIS_DIFF)), rel=1e-12)


def test_pair_delta_refuses_unclipped_inputs():
    mech = trlaplace_mechanism(1.0, D, C, "corrected", 1e-5)
    with pytest.raises(ValueError, match="clip"):
        pair_delta(mech, torch.full((D,), 10.0, dtype=torch.float64))


def test_paper_calibration_domain_and_dummy_dimensions():
    with pytest.raises(ValueError, match="effective_dim"):
        trlaplace_mechanism(10.0, D, C, "paper")
    with pytest.warns(NotDifferentiallyPrivateWarning):  # delta defaults to 4^-d_eff
        mech = trlaplace_mechanism(10.0, D, C, "paper", effective_dim=500)
    assert mech.noise.truncation_mass == pytest.approx(0.894427191, rel=1e-9)


def test_repo_calibration_constants():
    assert repo_effective_dim(10, D) == 500
    assert repo_effective_dim(20, D) == 1700
    assert repo_effective_dim(5, D) == D
    with pytest.warns(NotDifferentiallyPrivateWarning):
        mech = trlaplace_mechanism(0.05, D, REPO_CLIP_NORM, "repo")
    assert mech.noise.bound == pytest.approx(0.0200580, rel=1e-5)  # Thm 3 with C = 0.005
    assert math.sqrt(mech.variance) == pytest.approx(0.0115721, rel=1e-5)


def test_ledger_never_reports_a_guarantee_for_paper_modes():
    ledger = PrivacyLedger("basic")
    ledger.record(paper(0.1))
    assert math.isinf(ledger.spent().epsilon)


def test_corrected_needs_delta():
    with pytest.raises(ValueError, match="needs delta"):
        trlaplace_mechanism(1.0, D, C, "corrected")
    with pytest.raises(ValueError, match="calibration"):
        trlaplace_mechanism(1.0, D, C, "exact", 1e-5)
